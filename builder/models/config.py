"""Decoder-only transformer configurations: read from a Hugging Face ``config.json`` or named.

One dataclass covers the Llama 3 family (Llama 3.x, and Qwen 3 = Llama with q/k RMSNorm and an
explicit head dim) and the Gemma 3 text decoder (sliding/global layers with two RoPE bases, four
norms per layer, (1 + w) norms, GELU-tanh MLP, √hidden embedding scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

ARCHS = ("llama", "qwen3", "gemma3")


@dataclass(frozen=True)
class RopeSpec:
    """How one kind of layer rotates q and k (types: default, linear, llama3)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim/2], computed in float32 as the reference implementation does."""
        exponent = (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim))
        inv = (1.0 / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.rope_type == "default":
            return inv
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            old_ctx = float(self.original_max_position_embeddings)
            low_wavelen = old_ctx / self.low_freq_factor
            high_wavelen = old_ctx / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old_ctx / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        raise ValueError(f"unsupported rope_type {self.rope_type!r} (supported: default, linear, llama3)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]          # per layer: "full" or "sliding"
    rope: dict[str, RopeSpec]             # per layer type
    sliding_window: int | None = None
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; expected one of {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")

    @property
    def is_gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(scalar) ** -0.5

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter by its Hugging Face name, with its shape."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.is_gemma:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def stacked_weights(self) -> dict[str, tuple[str, ...]]:
        """Weights the decoder graph reads as one matrix, stacked along rows at build time: per layer
        q/k/v (and their biases) as ``self_attn.qkv_proj``, gate/up as ``mlp.gate_up_proj``. Decode then
        runs one GEMV where it ran three (or two): on the H200 (benchmarks/gemv_sweep.py, best
        configurations) gemma3-4b's stacked q/k/v reads at 2.8 TB/s where its separate q / k / v GEMVs
        reach 2.4 / 1.6 / 1.6, and each launch saved is ~2 us of a decode step."""
        out: dict[str, tuple[str, ...]] = {}
        for i in range(self.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out[a + "qkv_proj.weight"] = tuple(a + f"{x}_proj.weight" for x in "qkv")
            if self.attention_bias:
                out[a + "qkv_proj.bias"] = tuple(a + f"{x}_proj.bias" for x in "qkv")
            out[m + "gate_up_proj.weight"] = (m + "gate_proj.weight", m + "up_proj.weight")
        return out

    def graph_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The weights as the entry graphs (and packages) hold them: :meth:`weight_shapes` with each
        :meth:`stacked_weights` group replaced by its stack, where its first part was."""
        shapes = self.weight_shapes()
        first = {parts[0]: (name, parts) for name, parts in self.stacked_weights().items()}
        stacked = {p for parts in self.stacked_weights().values() for p in parts}
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            if name in first:
                fused, parts = first[name]
                out[fused] = (sum(shapes[p][0] for p in parts), *shape[1:])
            elif name not in stacked:
                out[name] = shape
        return out

    def param_count(self) -> int:
        return sum(int(np.prod(s)) for s in self.weight_shapes().values())

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers ``config.json`` dict describing the same model."""
        base: dict[str, Any] = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        if self.is_gemma:
            base.update({
                "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh", "sliding_window": self.sliding_window,
                "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar),
                "attn_logit_softcapping": self.attn_logit_softcapping,
                "final_logit_softcapping": self.final_logit_softcapping,
                "layer_types": [f"{t}_attention" for t in self.layer_types],
                "rope_parameters": {f"{t}_attention": _rope_dict(r) for t, r in self.rope.items()},
            })
        else:
            base.update({
                "architectures": ["Qwen3ForCausalLM" if self.arch == "qwen3" else "LlamaForCausalLM"],
                "model_type": self.arch, "hidden_act": self.hidden_act,
                "rope_parameters": _rope_dict(self.rope["full"]),
            })
        return base


def _rope_dict(r: RopeSpec) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type in ("linear", "llama3"):
        d["factor"] = r.factor
    if r.rope_type == "llama3":
        d.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                 original_max_position_embeddings=r.original_max_position_embeddings)
    return d


# ===================================================================== from config.json
def _rope_from(params: dict[str, Any] | None, legacy_theta: float | None, legacy_scaling: dict | None,
               default_theta: float) -> RopeSpec:
    p = dict(params or {})
    if legacy_scaling:
        p = {**legacy_scaling, **p}
    theta = p.get("rope_theta", legacy_theta if legacy_theta is not None else default_theta)
    rtype = p.get("rope_type", p.get("type", "default"))
    kwargs = {k: p[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
              if k in p and p[k] is not None}
    spec = RopeSpec(theta=float(theta), rope_type=rtype, **kwargs)
    spec.inv_freq(2)  # validates the type
    return spec


def _eos(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Our config from a Hugging Face ``config.json`` dict (text part of multimodal Gemma 3 included)."""
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        outer = cfg
        cfg = {**cfg["text_config"]}
        cfg.setdefault("model_type", "gemma3_text" if "gemma3" in str(outer.get("model_type")) else None)
        for k in ("bos_token_id", "eos_token_id"):
            cfg.setdefault(k, outer.get(k))
    mtype = str(cfg.get("model_type", ""))
    archs = " ".join(cfg.get("architectures") or [])
    if mtype.startswith("gemma3") or "Gemma3" in archs:
        arch = "gemma3"
    elif mtype == "qwen3" or "Qwen3" in archs:
        arch = "qwen3"
    elif mtype == "llama" or "Llama" in archs:
        arch = "llama"
    else:
        raise ValueError(f"unsupported model_type {mtype or '?'!r} (supported: llama, qwen3, gemma3_text)")
    try:
        n_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        common = dict(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=n_layers, num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=_eos(cfg.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json is missing or has a bad value for {exc}") from None
    if arch == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6) or 6)
        lt = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        layer_types = tuple("sliding" if t.startswith("sliding") else "full" for t in lt)
        rp = cfg.get("rope_parameters") or {}
        full_params = rp.get("full_attention") if isinstance(rp.get("full_attention"), dict) else None
        slide_params = rp.get("sliding_attention") if isinstance(rp.get("sliding_attention"), dict) else None
        rope = {
            "full": _rope_from(full_params, cfg.get("rope_theta"), cfg.get("rope_scaling"), 1_000_000.0),
            "sliding": _rope_from(slide_params, cfg.get("rope_local_base_freq"), None, 10_000.0),
        }
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 3 activation {act!r}")
        return ModelConfig(
            arch=arch, layer_types=layer_types, rope=rope, sliding_window=int(cfg.get("sliding_window") or 4096),
            qk_norm=True, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"), hidden_act="gelu_tanh", **common)
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ValueError("sliding-window Llama/Qwen variants are not supported")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    rope = {"full": _rope_from(rp, cfg.get("rope_theta"), cfg.get("rope_scaling"), 10_000.0)}
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported activation {act!r} for {arch}")
    return ModelConfig(arch=arch, layer_types=("full",) * n_layers, rope=rope, qk_norm=(arch == "qwen3"),
                       hidden_act="silu", **common)


# ===================================================================== named configs
def _llama(**kw: Any) -> ModelConfig:
    n = kw.pop("num_layers")
    rope = kw.pop("rope")
    return ModelConfig(arch=kw.pop("arch", "llama"), num_layers=n, layer_types=("full",) * n,
                       rope={"full": rope}, **kw)


def _gemma(**kw: Any) -> ModelConfig:
    n = kw.pop("num_layers")
    pattern = kw.pop("pattern", 6)
    return ModelConfig(arch="gemma3", num_layers=n,
                       layer_types=tuple("sliding" if (i + 1) % pattern else "full" for i in range(n)),
                       qk_norm=True, tie_word_embeddings=True, hidden_act="gelu_tanh", **kw)


_LLAMA3_ROPE_1B = RopeSpec(theta=500_000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA3_ROPE_8B = replace(_LLAMA3_ROPE_1B, factor=8.0)
_GEMMA_ROPE = {"full": RopeSpec(theta=1_000_000.0, rope_type="linear", factor=8.0),
               "sliding": RopeSpec(theta=10_000.0)}

NAMED_CONFIGS: dict[str, ModelConfig] = {
    "llama3-1b": _llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope=_LLAMA3_ROPE_1B,
                        tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=128000,
                        eos_token_id=(128001, 128008, 128009)),
    "llama3-8b": _llama(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope=_LLAMA3_ROPE_8B,
                        tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=128000,
                        eos_token_id=(128001, 128008, 128009)),
    "qwen3-0.6b": _llama(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                         num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         rope=RopeSpec(theta=1_000_000.0), qk_norm=True, tie_word_embeddings=True,
                         max_position_embeddings=40960, bos_token_id=151643, eos_token_id=(151645,)),
    "gemma3-4b": _gemma(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
                        num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope=_GEMMA_ROPE, sliding_window=1024,
                        query_pre_attn_scalar=256.0, max_position_embeddings=131072, bos_token_id=2,
                        eos_token_id=(1, 106)),
    # Tiny variants: same structure (GQA, q/k norm, sliding layers, llama3/linear RoPE), test-sized.
    "tiny-llama": _llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope=replace(_LLAMA3_ROPE_1B, original_max_position_embeddings=64),
                         tie_word_embeddings=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=(2,)),
    "tiny-qwen3": _llama(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         rope=RopeSpec(theta=1_000_000.0), qk_norm=True, tie_word_embeddings=False,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=(2,)),
    "tiny-gemma3": _gemma(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=_GEMMA_ROPE, sliding_window=4,
                          query_pre_attn_scalar=16.0, max_position_embeddings=256, bos_token_id=2,
                          eos_token_id=(1,), pattern=3),
}


def named_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(NAMED_CONFIGS)}") from None


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x
