"""Model weights: from a Hugging Face checkpoint folder (``*.safetensors``, sharded or not) or random.

Safetensors files are read through a memory map with our own header parser: the ``safetensors``
package's numpy path has no bfloat16, and a map lets a 4B model be inspected without reading it.
Random weights are generated per tensor from a seed and the tensor's name, so any one tensor can be
produced alone and identically on every machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import ml_dtypes
import numpy as np

from lum.builder.models.config import ModelConfig
from lum.format.dtypes import DType

_ST_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}
_MAX_HEADER = 100 * 1024 * 1024


class WeightSource(Protocol):
    def names(self) -> list[str]: ...

    def get(self, name: str) -> np.ndarray: ...


@dataclass
class _Entry:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: safetensors header is not valid JSON") from None
    return header, 8 + n


class SafetensorsFolder:
    """All tensors of a checkpoint folder, read lazily through memory maps."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.folder}: no *.safetensors files")
        self._entries: dict[str, _Entry] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in files:
            header, data_start = read_safetensors_header(path)
            size = path.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dt = _ST_DTYPES.get(info.get("dtype"))
                if dt is None:
                    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
                start, end = (data_start + int(o) for o in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
                if end > size or end - start != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                    raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets")
                self._entries[name] = _Entry(path, dt, shape, start, end)

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def get(self, name: str) -> np.ndarray:
        e = self._entries[name]
        mm = self._maps.get(e.path)
        if mm is None:
            mm = self._maps[e.path] = np.memmap(e.path, dtype=np.uint8, mode="r")
        return mm[e.start:e.end].view(e.dtype).reshape(e.shape)


class CheckpointWeights:
    """Weights of an HF checkpoint under our canonical names (``model.…``, ``lm_head.weight``)."""

    def __init__(self, folder: Path, config: ModelConfig):
        self.files = SafetensorsFolder(folder)
        self.config = config
        names = self.files.names()
        embed = [n for n in names if n.endswith("embed_tokens.weight")]
        if not embed:
            raise ValueError(f"{folder}: no embed_tokens.weight among {len(names)} tensors")
        prefix = embed[0][: -len("model.embed_tokens.weight")] if embed[0].endswith("model.embed_tokens.weight") \
            else embed[0][: -len("embed_tokens.weight")]
        self._map: dict[str, str] = {}
        for canonical in config.weight_shapes():
            for cand in _candidates(canonical, prefix):
                if cand in self.files._entries:
                    self._map[canonical] = cand
                    break
        missing = [n for n in config.weight_shapes() if n not in self._map]
        if missing:
            raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        for canonical, shape in config.weight_shapes().items():
            have = self.files.shape(self._map[canonical])
            if have != shape:
                raise ValueError(f"{folder}: tensor {canonical!r} has shape {have}, config implies {shape}")

    def names(self) -> list[str]:
        return list(self._map)

    def get(self, name: str) -> np.ndarray:
        return self.files.get(self._map[name])


def _candidates(canonical: str, prefix: str) -> Iterator[str]:
    yield canonical
    if canonical.startswith("model."):
        rest = canonical[len("model."):]
        yield prefix + "model." + rest
        yield prefix + rest
        yield "model.language_model." + rest
        yield "language_model.model." + rest
    else:
        yield prefix + canonical
        yield "language_model." + canonical


class RandomWeights:
    """Seeded random weights; each tensor depends only on (seed, name), never on generation order."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config = config
        self.seed = seed
        self._shapes = config.weight_shapes()

    def names(self) -> list[str]:
        return list(self._shapes)

    def get(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        if name.endswith("norm.weight"):
            # Gemma scales by (1 + w): centre its norms on 0; Llama-style norms on 1.
            centre = 0.0 if self.config.is_gemma else 1.0
            return (centre + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith(".bias"):
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)
        fan_in = shape[-1]
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


class GraphWeights:
    """A checkpoint's weights under the entry graphs' names (``ModelConfig.graph_weight_shapes``):
    stacked groups are concatenated along rows when asked for; every other name passes through.
    ``source`` is the checkpoint's own view (Hugging Face names)."""

    def __init__(self, source: WeightSource, config: ModelConfig):
        self.source, self.config = source, config
        self._stacks = config.stacked_weights()
        self._names = list(config.graph_weight_shapes())

    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> np.ndarray:
        parts = self._stacks.get(name)
        if parts is None:
            return self.source.get(name)
        return np.concatenate([np.asarray(self.source.get(p)) for p in parts], axis=0)


def cast_weight(x: np.ndarray, dtype: DType) -> np.ndarray:
    return np.ascontiguousarray(x.astype(dtype.np, copy=False))


def save_hf_checkpoint(folder: Path, config: ModelConfig, weights: WeightSource, dtype: DType = DType.f32) -> None:
    """Write ``config.json`` + ``model.safetensors`` (used to make test checkpoints without torch)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype.value]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    st_name = {DType.f32: "F32", DType.bf16: "BF16", DType.f16: "F16"}[dtype]
    header: dict = {}
    blobs = []
    offset = 0
    for name in weights.names():
        arr = cast_weight(weights.get(name), dtype)
        header[name] = {"dtype": st_name, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        blobs.append(arr.tobytes())
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
