"""Greedy generation on the HLIR reference interpreter: prefill, then decode steps with the KV cache."""

from __future__ import annotations

import numpy as np

from lum.builder.models import ModelSpec
from lum.builder.reference import run_graph


class ReferenceModel:
    """Runs a ModelSpec's entry graphs on numpy, carrying the KV caches between calls."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.weights = {n: np.asarray(spec.weights.get(n)) for n in spec.weights.names()}
        cfg = spec.config
        shape = (spec.max_seq, cfg.num_kv_heads, cfg.head_dim)
        self.state = {n: np.zeros(shape, dtype=spec.dtype.np) for n in spec.state_names}
        self.pos = 0

    def _run(self, entry: str, tokens: np.ndarray, dyn: dict[str, int]) -> np.ndarray:
        out = run_graph(self.spec.graphs[entry], {"tokens": tokens.astype(np.int32), **self.weights, **self.state}, dyn)
        for name in self.state:
            self.state[name] = out[name]
        return out["logits"]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        if self.pos:
            raise RuntimeError("prefill runs once, on an empty cache")
        logits = self._run("prefill", np.asarray(tokens), {"s": len(tokens)})
        self.pos = len(tokens)
        return logits

    def decode(self, token: int) -> np.ndarray:
        if self.pos >= self.spec.max_seq:
            raise RuntimeError(f"KV cache full ({self.spec.max_seq} positions)")
        logits = self._run("decode", np.asarray([token]), {"p": self.pos})
        self.pos += 1
        return logits

    def generate(self, tokens: list[int], max_new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy tokens and the logits of every step (prefill's last row, then each decode)."""
        logits = self.prefill(tokens)[-1]
        out, steps = [], [logits]
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if len(out) == max_new_tokens:
                break
            logits = self.decode(nxt)[-1]
            steps.append(logits)
        return out, steps
