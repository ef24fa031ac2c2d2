"""The decoder graph for the Llama 3 / Qwen 3 / Gemma 3 family, written in the GraphTensor API.

One function builds both entry graphs: ``prefill`` (``s`` new tokens at positions 0…s-1) and
``decode`` (one token at position ``p``). Both read and write the same per-layer KV caches
``k_cache.{i}``/``v_cache.{i}`` of shape [max_seq, kv_heads, head_dim] through Scatter, so the caches
are state that the loader carries from one call to the next. Activations have no batch dim.

Precision: weights and KV caches are stored in the model dtype; activations (the residual stream,
norms, rope, GEMM outputs) are f32 whatever that dtype is. A 16-bit model rounds only where the
narrow type pays: GEMM inputs (the GEMM reads 16-bit operands and accumulates and stores f32), the
KV cache, and the attention probabilities before ·V. On random-weight llama3-1b this halves the
logits' distance to the f32 computation compared with rounding every op's output (measured with a
torch emulation: 1.4e-2 vs 2.3e-2, what transformers' bf16 gives), at no cost to batch-1 decode,
whose traffic is the weights.

Graph breaks: each decoder layer is a chunk of its own (one compiled group for all alike layers). Gemma's
decode moves the other way: each layer's chunk ends with the next layer's input norm (``norms_ahead``).
(The opposite move, a Gemma layer's FFN post-norm residual into the next layer's chunk for the qkv GEMV's
prologue to compute, measured −0.6% twice on gemma3-4b and was removed: benchmarks/NOTES.md.)
"""

from __future__ import annotations

import os

import numpy as np

from lum.builder import frontend as F
from lum.builder.frontend import GraphTensor
from lum.builder.hlir import Graph
from lum.builder.models.config import ModelConfig
from lum.format.dtypes import DType
from lum.format.expr import Expr, ExprLike, Var, as_expr

NEG_INF = float("-inf")

ENV_NORMS_AHEAD = "LUM_NORMS_AHEAD"


def norms_ahead(cfg: ModelConfig, entry: str) -> bool:
    """Whether each layer's chunk ends with the next layer's input norm (the final norm after the last).

    Decode only, where the qkv is a GEMV with a norm prologue (prefill's GEMMs have none). A Gemma layer
    ends in a row kernel that already reads the whole residual row (its post-FFN norm and residual add),
    so the next input norm adds one block reduction there, and the next qkv GEMV loses its norm prologue
    (its row read, block reduction and barriers before the first multiply-add) and the LM head its norm
    kernel. The last layer, which hands no residual on, becomes a group of its own. A Llama layer ends in
    down's residual epilogue: there the norm is a kernel of its own (two blocks: the residual sum and its norm),
    so by default it stays the qkv's prologue; with it ahead, llama3-1b's qkv becomes 384 blocks that copy all
    their weights into shared memory behind that small kernel, as gemma3-4b's do: measured even on an H100
    (478f304, 963.5 against 963.6 tok/s).
    ``LUM_NORMS_AHEAD=0/1`` overrides the default for measurement (decode only). Measured on gemma3-4b (H100,
    cba5a57, both orders, tokens equal over 145): +0.3% (319.6 / 319.8 against 318.7 / 318.8 tok/s); the
    qkv's link 3.9 → 3.1 µs, the last residual kernel's 2.3 → 3.1 µs (benchmarks/NOTES.md).
    """
    if entry != "decode":
        return False
    raw = os.environ.get(ENV_NORMS_AHEAD, "").strip()
    if raw in ("0", "1"):
        return raw == "1"
    if raw:
        raise ValueError(f"{ENV_NORMS_AHEAD} must be 0 or 1, got {raw!r}")
    return cfg.is_gemma


def cache_names(cfg: ModelConfig) -> list[str]:
    return [f"{kind}_cache.{i}" for i in range(cfg.num_layers) for kind in ("k", "v")]


def build_entry(cfg: ModelConfig, entry: str, max_seq: int, dtype: DType = DType.f32) -> Graph:
    """The HLIR graph of ``entry`` ("prefill" or "decode")."""
    if entry == "prefill":
        s: ExprLike = Var("s")
        past: ExprLike = 0
    elif entry == "decode":
        s, past = 1, Var("p")
    else:
        raise ValueError(f"unknown entry {entry!r}; expected 'prefill' or 'decode'")
    return DecoderBuilder(cfg, entry, as_expr(s), as_expr(past), max_seq, dtype).build()


class DecoderBuilder:
    def __init__(self, cfg: ModelConfig, name: str, s: Expr, past: Expr, max_seq: int, dtype: DType):
        self.cfg, self.s, self.past, self.max_seq, self.dtype = cfg, s, past, max_seq, dtype
        self.index: GraphTensor | None = None      # decode's index table (see arange)
        self.act = DType.f32                       # activations (module docstring)
        self.g = Graph(name)
        self._weights: dict[str, GraphTensor] = {}
        self._weight_shapes = cfg.graph_weight_shapes()
        self.positions: GraphTensor | None = None   # [s] i64 token positions, set by build()
        self.norms_ahead = norms_ahead(cfg, name)

    # ------------------------------------------------------------------ helpers
    def w(self, name: str) -> GraphTensor:
        """The weight input ``name`` (created on first use, in the chunk that first uses it)."""
        t = self._weights.get(name)
        if t is None:
            shape = self._weight_shapes[name]
            t = self._weights[name] = F.input_tensor(self.g, name, shape, self.dtype, role="weight")
        return t

    def norm(self, x: GraphTensor, name: str) -> GraphTensor:
        return F.rms_norm(x, self.w(name), self.cfg.rms_norm_eps, add_one=self.cfg.is_gemma)

    def proj(self, x: GraphTensor, prefix: str) -> GraphTensor:
        """A linear layer: ``x`` rounded to the weights' dtype, the result in the activation dtype."""
        bias = self.w(prefix + ".bias") if self.cfg.attention_bias and prefix.endswith("qkv_proj") else None
        return F.linear(x.cast(self.dtype), self.w(prefix + ".weight"), bias, out_dtype=self.act)

    # ------------------------------------------------------------------ graph
    def build(self) -> Graph:
        cfg, g = self.cfg, self.g
        tokens = F.input_tensor(g, "tokens", [self.s], DType.i32)
        x = F.gather(self.w("model.embed_tokens.weight"), tokens).cast(self.act)
        if cfg.is_gemma:
            x = x * F.constant(g, cfg.hidden_size ** 0.5, self.act)
        positions = self.arange(self.past, self.past + self.s)
        self.positions = positions
        kinds = sorted(set(cfg.layer_types))
        tables = {kind: F.rope_tables(g, positions, cfg.rope[kind].inv_freq(cfg.head_dim), self.act) for kind in kinds}
        masks = {kind: self.mask(kind, positions, self.past + self.s) for kind in kinds}   # once, not per layer
        normed = self.input_norm(x, 0) if self.norms_ahead else None
        for i in range(cfg.num_layers):
            g.graph_break()
            x, normed = self.layer(i, x, normed, tables[cfg.layer_types[i]], masks[cfg.layer_types[i]])
        g.graph_break()
        if normed is None:
            normed = self.input_norm(x, cfg.num_layers)
        head = self.w("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        logits = F.linear(normed, head, out_dtype=self.act).cast(DType.f32)
        if cfg.final_logit_softcapping:
            cap = float(cfg.final_logit_softcapping)
            logits = F.tanh(logits * (1.0 / cap)) * cap
        F.output(logits, "logits")
        # greedy decoding's next token, on the device: a generate loop can feed it to the next step
        # without waiting for the logits to reach the host (loader/model.py Session.generate)
        F.output(F.argmax(logits.slice(0, self.s - 1, self.s)), "next_token")
        return g

    def input_norm(self, x: GraphTensor, i: int) -> GraphTensor:
        """Layer ``i``'s input norm (the final norm past the last layer) in the model dtype: in layer ``i``'s
        chunk, or with ``norms_ahead`` in the chunk before."""
        name = f"model.layers.{i}.input_layernorm.weight" if i < self.cfg.num_layers else "model.norm.weight"
        return self.norm(x, name).cast(self.dtype)

    def layer(self, i: int, x: GraphTensor, normed: GraphTensor | None, rope: tuple[GraphTensor, GraphTensor],
              mask: GraphTensor) -> tuple[GraphTensor, GraphTensor | None]:
        """Decoder layer ``i``'s output and, with ``norms_ahead``, the next layer's normed input."""
        cfg, p = self.cfg, f"model.layers.{i}."
        residual = x
        h = normed if normed is not None else self.input_norm(x, i)
        h = self.attention(i, h, rope, mask)
        if cfg.is_gemma:
            h = self.norm(h, p + "post_attention_layernorm.weight")
        x = residual + h
        residual = x
        h = self.norm(x, p + ("pre_feedforward_layernorm.weight" if cfg.is_gemma else "post_attention_layernorm.weight"))
        h = self.mlp(p, h)
        if cfg.is_gemma:
            h = self.norm(h, p + "post_feedforward_layernorm.weight")
        x = residual + h
        return x, (self.input_norm(x, i + 1) if self.norms_ahead else None)

    def mlp(self, p: str, x: GraphTensor) -> GraphTensor:
        inter = self.cfg.intermediate_size
        gate_up = self.proj(x, p + "mlp.gate_up_proj")              # stacked weights (config.stacked_weights)
        gate, up = gate_up.slice(1, 0, inter), gate_up.slice(1, inter, 2 * inter)
        act = gate.gelu() if self.cfg.hidden_act == "gelu_tanh" else gate.silu()
        return self.proj(act * up, p + "mlp.down_proj")

    def attention(self, i: int, x: GraphTensor, rope: tuple[GraphTensor, GraphTensor], mask: GraphTensor) -> GraphTensor:
        cfg, g, s = self.cfg, self.g, self.s
        p = f"model.layers.{i}.self_attn."
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = nh // nkv
        qkv = self.proj(x, p + "qkv_proj")                           # stacked weights (config.stacked_weights)
        q = qkv.slice(1, 0, nh * hd).reshape(s, nh, hd)
        k = qkv.slice(1, nh * hd, (nh + nkv) * hd).reshape(s, nkv, hd)
        v = qkv.slice(1, (nh + nkv) * hd, (nh + 2 * nkv) * hd).reshape(s, nkv, hd)
        if cfg.qk_norm:
            q = self.norm(q, p + "q_norm.weight")
            k = self.norm(k, p + "k_norm.weight")
        cos, sin = rope
        # q in the [nh, s, hd] layout of q·k, rounded to 16 bits in RoPE's own kernel (flash attention's
        # operands); k in the cache's [s, nkv, hd] layout (the tables broadcast over the heads), so the
        # cache write's rounding fuses into RoPE's kernel too
        q = F.rope(q.permute(1, 0, 2), cos, sin).cast(self.dtype)                # [nh, s, hd]
        k = F.rope(k, cos.unsqueeze(1), sin.unsqueeze(1))                       # [s, nkv, hd]

        # KV cache: write the new rows at their positions, then read rows [0, past + s).
        total = self.past + s
        caches = []
        for kind, new in (("k", k), ("v", v)):
            cache = F.input_tensor(g, f"{kind}_cache.{i}", [self.max_seq, nkv, hd], self.dtype, role="state")
            updated = F.scatter(cache, new, self.positions)
            F.output(updated, f"{kind}_cache.{i}", role="state")
            caches.append(updated)
        k_cache, v_cache = caches

        def heads(t: GraphTensor) -> GraphTensor:
            """Rows [0, past + s) of a cache as [nkv, group, T, hd]: broadcast over a KV head's group (GQA)."""
            return t.slice(0, 0, total).permute(1, 0, 2).expand_dim(1, group)

        # q·k as flash attention computes it: 16-bit operands (q rounded above; the cache widened as a
        # whole before the views, so rules/flatten.egg's widened-product rule reads it as stored and nothing
        # is widened in memory), products summed and kept in f32 — rounding the scores to bf16 before the
        # softmax would put errors of ~0.4% of the logit into exp(). No-op casts for f32 models.
        f32 = DType.f32
        qg = q.reshape(nkv, group, s, hd).cast(f32)
        scores = F.matmul(qg, heads(k_cache.cast(f32)).transpose(-2, -1)) * cfg.attn_scale   # [nkv, group, s, T]
        if cfg.attn_logit_softcapping:
            cap = float(cfg.attn_logit_softcapping)
            scores = F.tanh(scores * (1.0 / cap)) * cap
        scores = F.where(mask, scores, NEG_INF)
        probs = scores.softmax(-1).cast(self.dtype)
        out = F.matmul(probs, heads(v_cache))                        # [nkv, group, s, hd]
        out = out.reshape(nh, s, hd).permute(1, 0, 2).reshape(s, nh * hd)
        return self.proj(out, p + "o_proj")

    def arange(self, start: Expr | int, stop: Expr) -> GraphTensor:
        """Indices ``start .. stop`` (i64). Decode slices a constant table of ``max_seq`` indices at run time
        rather than running iota kernels: its step's first ops (RoPE tables, mask, embedding gather) then read
        nothing a kernel writes and run as one sibling launch. Prefill (``start`` 0) keeps its iota, one launch
        a prompt: with the table the cost model splits its RoPE and mask chains into four kernels."""
        if self.past == as_expr(0):
            if as_expr(start) != as_expr(0):
                raise ValueError("prefill's indices start at 0")
            return F.arange(self.g, stop)
        if self.index is None:
            self.index = F.constant_table(self.g, np.arange(self.max_seq), DType.i64)
        return self.index.slice(0, start, stop)

    def mask(self, kind: str, positions: GraphTensor, total: Expr) -> GraphTensor:
        """[s, T] bool for layers of ``kind``: key j is visible to query at position q when j ≤ q (and, in a
        sliding layer, q − j < window). Built once per entry and read by every layer of that kind."""
        kpos = self.arange(0, total).unsqueeze(0)       # [1, T]
        qpos = positions.unsqueeze(1)                   # [s, 1]
        visible = kpos < qpos + 1
        if kind == "sliding" and self.cfg.sliding_window:
            visible = F.logical_and(visible, qpos < kpos + int(self.cfg.sliding_window))
        return visible
