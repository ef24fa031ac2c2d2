"""The model graphs against transformers on the same weights (HLIR reference interpreter, f32)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from lum.builder.models import load_spec
from lum.builder.models.config import config_from_hf, named_config
from lum.builder.models.generate import ReferenceModel
from lum.builder.models.transformer import norms_ahead
from lum.builder.partition import group_chunks
from tests.hf_checkpoints import save_hf_model
from tests.model_layers import layer_groups

TINY = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]
PROMPT = [1, 5, 9, 3, 17, 100, 7, 8, 42, 11]  # longer than tiny-gemma3's sliding window (4)
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=TINY)
def hf_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, folder)
    return request.param, folder, model


def test_prefill_and_decode_match_transformers(hf_folder):
    name, folder, model = hf_folder
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=DECODE_STEPS + 1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, len(PROMPT):].tolist()
    hf_logits = [step[0].double().numpy() for step in out.logits]

    spec = load_spec(src=folder, max_seq=32)
    ref = ReferenceModel(spec)
    prefill_logits = ref.prefill(PROMPT)
    with torch.no_grad():
        full = model(torch.tensor([PROMPT])).logits[0].double().numpy()
    assert prefill_logits.shape == full.shape
    assert _rel_err(prefill_logits, full) < 1e-4, "every prefill row must match, not only the last"

    tokens, steps = [], [prefill_logits[-1]]
    for _ in range(DECODE_STEPS):
        tokens.append(int(np.argmax(steps[-1])))
        steps.append(ref.decode(tokens[-1])[-1])
    tokens.append(int(np.argmax(steps[-1])))
    assert len(steps) == DECODE_STEPS + 1
    for k, (ours, theirs) in enumerate(zip(steps, hf_logits)):
        assert np.isfinite(ours).all()
        assert _rel_err(ours, theirs) < 1e-4, f"step {k}"
    assert tokens == hf_tokens
    assert len(set(tokens)) > 1, "weights too degenerate to test greedy decoding"


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_sharded_bf16_checkpoint_loads(tmp_path):
    model = save_hf_model("tiny-qwen3", tmp_path, dtype=torch.bfloat16, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    spec = load_spec(src=tmp_path, dtype="bf16", max_seq=16)
    params = dict(model.named_parameters())
    for name in spec.weights.source.names():
        ours = np.asarray(spec.weights.source.get(name)).astype(np.float32)
        theirs = params[name].detach().float().numpy()
        np.testing.assert_array_equal(ours, theirs)
    assert "lm_head.weight" in spec.weights.names()  # tiny-qwen3 is untied
    # the graphs read q/k/v and gate/up stacked along rows
    for stack, parts in spec.config.stacked_weights().items():
        want = np.concatenate([params[p].detach().float().numpy() for p in parts], axis=0)
        np.testing.assert_array_equal(np.asarray(spec.weights.get(stack)).astype(np.float32), want)
    assert set(spec.weights.names()) == set(spec.config.graph_weight_shapes())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_bf16_graph_is_closer_to_f32_than_transformers_bf16(name, tmp_path):
    """lum's bf16 graphs round only GEMM inputs, the KV cache and attention probabilities (activations
    stay f32), so on the same bf16 weights they land nearer the f32 computation than transformers' bf16,
    which rounds every op's output."""
    model = save_hf_model(name, tmp_path, dtype=torch.bfloat16)
    spec = load_spec(src=tmp_path, dtype="bf16", max_seq=16)
    logits = ReferenceModel(spec).prefill(PROMPT[:6])
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT[:6]])).logits[0].float().numpy()
        exact = model.float()(torch.tensor([PROMPT[:6]])).logits[0].numpy()
    ours_err, theirs_err = _rel_err(logits, exact), _rel_err(theirs, exact)
    assert ours_err < theirs_err, (ours_err, theirs_err)
    assert _rel_err(logits, theirs) < 3e-2


@pytest.mark.parametrize("name", ["llama3-1b", "llama3-8b", "qwen3-0.6b", "gemma3-4b"])
def test_real_configs_build_without_weights(name):
    t0 = time.perf_counter()
    spec = load_spec(random_name=name)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10
    cfg = named_config(name)
    expected = {"llama3-1b": 1.236e9, "llama3-8b": 8.03e9, "qwen3-0.6b": 0.596e9, "gemma3-4b": 3.88e9}[name]
    assert abs(spec.param_count - expected) / expected < 0.01
    for graph in spec.graphs.values():
        layers = layer_groups(graph)     # with the norms ahead, the last layer is a group of its own
        assert sum(len(g.chunks) for g in layers) == cfg.num_layers
        assert len(layers) == (2 if norms_ahead(cfg, graph.name) else 1)


def test_gemma3_multimodal_config_reads_text_part():
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 256,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1000000.0,
                        "rope_local_base_freq": 10000.0, "model_type": "gemma3_text"},
        "eos_token_id": [1, 106],
    }
    cfg = config_from_hf(raw)
    ref = named_config("gemma3-4b")
    assert cfg.layer_types == ref.layer_types and cfg.layer_types.count("full") == 5
    assert cfg.rope == ref.rope
    assert cfg.weight_shapes() == ref.weight_shapes()


def test_legacy_llama_rope_scaling_keys():
    raw = json.loads(json.dumps(named_config("llama3-1b").to_hf_dict()))
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    assert config_from_hf(raw).rope == named_config("llama3-1b").rope


@pytest.mark.parametrize("bad,msg", [
    ({"model_type": "mistral"}, "unsupported model_type"),
    ({"model_type": "llama", "hidden_size": 8}, "missing"),
])
def test_bad_configs_raise_clear_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        config_from_hf(bad)


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_spec(src=tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        load_spec(src=tmp_path)
    with pytest.raises(ValueError, match="unknown model name"):
        load_spec(random_name="gpt-5")


@pytest.mark.parametrize("name", TINY)
def test_norms_ahead_move_decode_input_norms_into_the_layer_before(monkeypatch, name):
    """``norms_ahead``: a decode layer ends with the next layer's input norm (the last one with the final
    norm), so no decode GEMV takes an input norm as its prologue: each layer keeps one prologue GEMV (the
    post-attention residual's norm: Gemma's gate-up takes it from a row kernel, Llama's and Qwen's gate-up
    compute it), not two, and the LM head none. On by default for Gemma, whose layer already ends in a row
    kernel; ``LUM_NORMS_AHEAD=1`` gives it to Llama and Qwen too, whose layer then ends in a norm kernel of
    its own. The computation is the same one (the norm in f32, rounded to the weights' dtype), so the logits
    are bit-equal."""
    from lum.builder.compile import compile_group
    from lum.builder.models.transformer import ENV_NORMS_AHEAD
    from lum.builder.partition import chunk_graph, partition

    def decode(flag: str):
        monkeypatch.setenv(ENV_NORMS_AHEAD, flag)
        spec = load_spec(random_name=name, dtype="bf16", max_seq=32)
        ref = ReferenceModel(spec)
        ref.prefill(PROMPT[:6])
        logits = [ref.decode(t) for t in PROMPT[6:9]]
        g = spec.graphs["decode"]
        prologues = 0
        for grp in group_chunks(g, partition(g)):
            prog = compile_group(chunk_graph(g, grp.representative))[0]
            prologues += len(grp.chunks) * sum(1 for o in prog.ops if o.kind == "gemm" and "expr" in o.params)
        return logits, prologues, spec.config

    ahead, ahead_prologues, cfg = decode("1")
    behind, behind_prologues, _ = decode("0")
    assert all(np.isfinite(a).all() and np.array_equal(a, b) for a, b in zip(ahead, behind, strict=True))
    assert behind_prologues == 2 * cfg.num_layers + 1
    assert ahead_prologues == cfg.num_layers
    monkeypatch.delenv(ENV_NORMS_AHEAD)
    assert norms_ahead(cfg, "decode") == cfg.is_gemma and not norms_ahead(cfg, "prefill")
    monkeypatch.setenv(ENV_NORMS_AHEAD, "yes")
    with pytest.raises(ValueError, match="LUM_NORMS_AHEAD must be 0 or 1"):
        norms_ahead(cfg, "decode")
