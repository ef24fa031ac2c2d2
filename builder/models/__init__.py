"""Model definitions: configs, weights and the entry graphs of the supported LLM families."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lum.builder.hlir import Graph
from lum.builder.models.config import NAMED_CONFIGS, ModelConfig, config_from_hf, named_config
from lum.builder.models.transformer import build_entry, cache_names
from lum.builder.models.weights import CheckpointWeights, GraphWeights, RandomWeights, WeightSource
from lum.format.dtypes import DType

ENTRIES = ("prefill", "decode")
DEFAULT_MAX_SEQ = 4096

__all__ = ["ModelSpec", "load_spec", "load_config", "NAMED_CONFIGS", "ModelConfig", "named_config", "ENTRIES"]


@dataclass
class ModelSpec:
    """A model ready to compile: its config, entry graphs and (lazily) its weights."""

    name: str
    config: ModelConfig
    dtype: DType
    max_seq: int
    graphs: dict[str, Graph] = field(repr=False)
    weights: WeightSource = field(repr=False)
    source: str = ""

    @property
    def param_count(self) -> int:
        return self.config.param_count()

    @property
    def param_bytes(self) -> int:
        return self.param_count * self.dtype.itemsize

    @property
    def state_names(self) -> list[str]:
        return cache_names(self.config)


def load_config(src: str | Path) -> ModelConfig:
    folder = Path(src)
    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a directory (expected a Hugging Face checkpoint folder)")
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config_from_hf(raw)


def load_spec(src: str | Path | None = None, random_name: str | None = None, dtype: str | DType = "f32",
              max_seq: int | None = None, materialize: bool = False, seed: int = 0) -> ModelSpec:
    """Config, entry graphs and a weight source for an HF folder (``src``) or a named random model.

    Weights are never read here; ``materialize`` is accepted for API symmetry and validates that the
    checkpoint's tensors exist with the right shapes (an HF folder is always validated).
    """
    dtype = DType.parse(dtype) if isinstance(dtype, str) else dtype
    if dtype not in (DType.f32, DType.bf16, DType.f16):
        raise ValueError(f"model dtype must be f32, bf16 or f16, got {dtype}")
    if (src is None) == (random_name is None):
        raise ValueError("give either a checkpoint folder or --random NAME")
    if random_name is not None:
        cfg = named_config(random_name)
        weights: WeightSource = RandomWeights(cfg, seed)
        name, source = random_name, f"random:{random_name}:seed={seed}"
    else:
        cfg = load_config(src)
        weights = CheckpointWeights(Path(src), cfg)
        name, source = Path(src).name, str(Path(src).resolve())
    if max_seq is None:
        max_seq = min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ)
    if max_seq < 1:
        raise ValueError(f"max_seq must be positive, got {max_seq}")
    graphs = {entry: build_entry(cfg, entry, max_seq, dtype) for entry in ENTRIES}
    return ModelSpec(name, cfg, dtype, max_seq, graphs, GraphWeights(weights, cfg), source)
