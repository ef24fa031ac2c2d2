"""Partitioning at graph breaks, structural hashing and grouping of chunks (synthetic graphs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lum.builder import frontend as F
from lum.builder.hlir import Edge, Graph
from lum.builder.partition import (Chunk, canonical_text, group_chunks, partition, structural_hash)
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.shapetracker import ShapeTracker

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 8


# ====================================================================== synthetic models
def layer(g: Graph, x: F.GraphTensor, i: int, *, hidden: int = HIDDEN, eps: float = 1e-5,
          transposed_weight: bool = False, weights: dict | None = None, inv_freq=None) -> F.GraphTensor:
    """RMSNorm -> linear -> SiLU -> residual; weights named per layer (or taken from ``weights``)."""
    if weights is None:
        norm = F.input_tensor(g, f"layers.{i}.norm.weight", (hidden,), "f32", role="weight")
        shape = (hidden, hidden)
        w = F.input_tensor(g, f"layers.{i}.proj.weight", shape, "f32", role="weight")
    else:
        norm, w = weights[f"norm{i}"], weights[f"w{i}"]
    y = F.rms_norm(x, norm, eps)
    y = F.linear(y, w.T if transposed_weight else w)
    if inv_freq is not None:
        y = y * F.constant_table(g, inv_freq).unsqueeze(0)
    return x + y.silu()


def model(n_layers: int = 4, variant: dict[int, dict] | None = None, weights_upfront: bool = False,
          hidden: int = HIDDEN) -> Graph:
    """embed chunk, ``n_layers`` layer chunks, head chunk. ``variant[i]`` passes kwargs to layer i."""
    variant = variant or {}
    g = Graph("synthetic")
    s = Var("s")
    tokens = F.input_tensor(g, "tokens", (s,), "i64")
    table = F.input_tensor(g, "embed", (32, hidden), "f32", role="weight")
    weights = None
    if weights_upfront:
        weights = {}
        for i in range(n_layers):
            weights[f"norm{i}"] = F.input_tensor(g, f"n{i}", (hidden,), "f32", role="weight")
            weights[f"w{i}"] = F.input_tensor(g, f"w{i}", (hidden, hidden), "f32", role="weight")
    x = F.gather(table, tokens)
    for i in range(n_layers):
        g.graph_break()
        x = layer(g, x, i, weights=weights, **variant.get(i, {}))
    g.graph_break()
    head = F.input_tensor(g, "head", (32, hidden), "f32", role="weight")
    F.output(F.linear(F.rms_norm(x, None, 1e-5), head), "logits")
    return g


def layer_hashes(g: Graph) -> list[str]:
    chunks = partition(g)
    return [structural_hash(g, c) for c in chunks[1:-1]]


# ====================================================================== partition
def test_partition_covers_every_node_once_in_order():
    g = model(3)
    chunks = partition(g)
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    ids = [i for c in chunks for i in c.nodes]
    assert ids == list(range(len(g)))
    for c in chunks:
        assert all(g[i].chunk == c.index for i in c.nodes)


def test_chunk_interface():
    g = model(2)
    chunks = partition(g)
    embed, l0, l1, head = chunks
    # the layer reads exactly one tensor from outside: the previous chunk's activation
    assert l0.input_nodes == embed.outputs == (embed.nodes[-1],)
    assert l1.input_nodes == l0.outputs
    assert head.input_nodes == l1.outputs
    # the Output node's source is an output of its own chunk; nothing comes after the head
    out_node = g.outputs()[0]
    assert out_node.id in head.nodes
    assert head.outputs == (out_node.inputs[0].src,)
    for c in chunks:
        for e in c.inputs:
            assert g[e.src].chunk != c.index


def test_external_inputs_are_distinct_edges_in_first_use_order():
    g = Graph("ext")
    a = F.input_tensor(g, "a", (4, 4), "f32")
    b = F.input_tensor(g, "b", (4, 4), "f32")
    g.graph_break()
    y = b + a          # first use: b, then a
    z = y + a.T        # a again, through another view
    w = z + b          # b again, same view as before: not a new edge
    F.output(w, "out")
    c = partition(g)[1]
    assert [e.src for e in c.inputs] == [b.node, a.node, a.node]
    assert c.inputs[2].view == a.T.view
    assert c.input_nodes == (b.node, a.node)
    assert "ext 0 f32[4,4]" in canonical_text(g, c)


def test_decreasing_chunk_indices_are_rejected():
    g = model(2)
    g.nodes[-1].chunk = 0
    with pytest.raises(ValueError, match="must not decrease"):
        partition(g)


def test_graph_without_breaks_is_one_chunk_and_empty_graph_has_none():
    g = Graph("one")
    x = F.input_tensor(g, "x", (3,), "f32")
    F.output(x.exp2(), "y")
    assert [len(c) for c in partition(g)] == [len(g)]
    assert partition(Graph("empty")) == []
    assert group_chunks(Graph("empty")) == []


# ====================================================================== grouping
@pytest.mark.parametrize("weights_upfront", [False, True], ids=["weights-in-layer", "weights-in-chunk0"])
def test_identical_layers_with_different_weight_names_form_one_group(weights_upfront):
    g = model(5, weights_upfront=weights_upfront)
    groups = group_chunks(g)
    assert [g_.chunks for g_ in groups] == [(0,), (1, 2, 3, 4, 5), (6,)]
    layer_group = groups[1]
    assert layer_group.representative == partition(g)[1]
    assert len(layer_group) == 5
    assert len(layer_group.hash) == 64 and int(layer_group.hash, 16) >= 0


def test_names_do_not_enter_the_hash():
    g = model(2)
    text = canonical_text(g, partition(g)[1])
    assert "layers." not in text and "weight" in text  # role kept, name dropped
    # renaming every input and output changes nothing
    before = [structural_hash(g, c) for c in partition(g)]
    for n in g:
        if "name" in n.attrs:
            n.attrs["name"] = "renamed_" + n.attrs["name"]
    assert [structural_hash(g, c) for c in partition(g)] == before


@pytest.mark.parametrize("change", [
    pytest.param({"hidden": 16}, id="shape"),
    pytest.param({"transposed_weight": True}, id="stride"),
    pytest.param({"eps": 1e-6}, id="constant"),
    pytest.param({"inv_freq": np.array([1.0, 0.5, 0.25, 0.125, 1, 1, 1, 1.0000001])}, id="table"),
])
def test_one_different_layer_gets_its_own_hash(change):
    base_table = {"inv_freq": np.array([1.0, 0.5, 0.25, 0.125, 1, 1, 1, 1])} if "inv_freq" in change else {}
    if "hidden" in change:
        # a wider layer (the last one, so that no later layer reads its wider buffer): pad in, slice out
        g = Graph("shape")
        x = F.input_tensor(g, "x", (Var("s"), HIDDEN), "f32")
        for i, h in enumerate([HIDDEN, HIDDEN, HIDDEN, change["hidden"]]):
            g.graph_break()
            x = layer(g, x.pad(1, 0, h - HIDDEN) if h != HIDDEN else x, i, hidden=h)
            if h != HIDDEN:
                x = x.slice(1, 0, HIDDEN)
        g.graph_break()
        F.output(x, "y")
        hashes = layer_hashes(g)
        same, odd = [0, 1, 2], 3
    else:
        g = model(4, variant={0: base_table, 1: base_table, 2: change, 3: base_table})
        hashes = layer_hashes(g)
        same, odd = [0, 1, 3], 2
    assert len({hashes[i] for i in same}) == 1
    assert hashes[odd] != hashes[same[0]]
    groups = group_chunks(g)
    assert (odd + 1,) in [grp.chunks for grp in groups]  # chunk index = layer index + 1
    assert tuple(i + 1 for i in same) in [grp.chunks for grp in groups]


def test_attr_and_dtype_changes_change_the_hash():
    def one(op_attrs: dict, dtype: DType = DType.f32, offset: int = 0) -> str:
        g = Graph("a")
        x = F.input_tensor(g, "x", (4, 6), dtype)
        view = ShapeTracker.contiguous((4, 6))
        if offset:
            view = view.slice(1, offset, 6).pad(1, 0, offset)
        g.graph_break()
        r = g.add("SumReduce", (Edge(x.node, view),), (as_expr(4),), dtype, **op_attrs)
        g.add("Output", (Edge(r.id, ShapeTracker.contiguous((4,))),), (as_expr(4),), dtype,
              name="o", role="output")
        return structural_hash(g, partition(g)[1])

    base = one({"axis": 1})
    assert one({"axis": 1}) == base
    assert one({"axis": 0}) != base                      # attr value
    assert one({"axis": 1, "extra": 0}) != base          # extra attr
    assert one({"axis": 1.0}) != base                    # int vs float attr
    assert one({"axis": 1}, dtype=DType.bf16) != base    # dtype
    assert one({"axis": 1}, offset=1) != base            # view offset / mask


def test_output_role_is_hashed_but_output_name_is_not():
    def g_with(role: str, name: str) -> str:
        g = Graph("o")
        x = F.input_tensor(g, "x", (4,), "f32")
        g.graph_break()
        F.output(x.exp2(), name, role=role)
        return structural_hash(g, partition(g)[1])

    assert g_with("output", "a") == g_with("output", "b")
    assert g_with("output", "a") != g_with("state", "a")


def test_attrs_without_a_canonical_form_are_refused():
    g = Graph("bad")
    n = g.add("Constant", (), (), DType.f32, value=object())
    with pytest.raises(TypeError, match="no canonical form"):
        structural_hash(g, Chunk(0, (n.id,), (), ()))


# ====================================================================== determinism
_ATTR_VALUES = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.text(max_size=4),
                         st.booleans(), st.none())
# Graph.add's own parameters (and the attributes this test sets) cannot be attribute names.
_RESERVED_ATTR_NAMES = {"name", "self", "op", "inputs", "shape", "dtype", "value", "table"}


@settings(max_examples=50, deadline=None)
@given(attrs=st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in _RESERVED_ATTR_NAMES),
                             _ATTR_VALUES,
                             min_size=1, max_size=6),
       nested=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 9), min_size=2, max_size=6),
       seed=st.integers(0, 2**16))
def test_hash_ignores_dict_insertion_order(attrs, nested, seed):
    rng = np.random.default_rng(seed)

    def shuffled(d: dict) -> dict:
        keys = list(d)
        rng.shuffle(keys)
        return {k: d[k] for k in keys}

    def build(a: dict) -> str:
        g = Graph("d")
        n = g.add("Constant", (), (), DType.f32, value=1.0, **a)
        return structural_hash(g, Chunk(0, (n.id,), (), ()))

    a1 = {**attrs, "table": nested}
    a2 = shuffled({**shuffled(attrs), "table": shuffled(nested)})
    assert build(a1) == build(a2)


_HASH_SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.test_partition import model
from lum.builder.partition import group_chunks
g = model(3, variant={{1: {{"eps": 1e-6}}}})
print(json.dumps([[grp.hash, list(grp.chunks)] for grp in group_chunks(g)]))
"""


@pytest.mark.slow
def test_hash_is_stable_across_processes_and_hash_seeds():
    g = model(3, variant={1: {"eps": 1e-6}})
    here = [[grp.hash, list(grp.chunks)] for grp in group_chunks(g)]
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", _HASH_SCRIPT.format(repo=str(REPO))], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == here
    assert [c for _, c in here] == [[0], [1, 3], [2], [4]]


def test_canonical_text_has_no_process_specific_tokens():
    g = model(2)
    text = canonical_text(g, partition(g)[1])
    assert "0x" not in text and "object at" not in text
    assert text.startswith("lum-chunk-v")
