"""Tiny Hugging Face checkpoints made by transformers itself, for reference tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from lum.builder.models import named_config

_CLASSES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM),
}


def make_hf_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  scale: float = 5.0):
    """A transformers model with the structure of our named config and random, non-trivial weights
    (built on ``device``: a 4B model initialises in seconds on a GPU, in minutes on a CPU)."""
    cfg = named_config(name).to_hf_dict()
    config_cls, model_cls = _CLASSES[cfg["model_type"]]
    hf_config = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(hf_config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))  # norms start at 0/1: make them matter
            else:
                p.mul_(scale)  # HF's std-0.02 init gives near-uniform logits on tiny models; widen it
    return model.to(dtype).eval()


def save_hf_model(name: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                  max_shard_size: str | None = None, device: str = "cpu", scale: float = 5.0):
    model = make_hf_model(name, seed, dtype, device, scale)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model
