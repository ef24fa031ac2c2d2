"""Flash attention (prefill) programs for the emulated and GPU tests: the attention LLIR
(builder/extract.attention_ops: chunk partials + combine) over the views the decoders read in prefill
(builder/models/transformer.py): q [nkv · group, s, D], a K / V cache [max_t, nkv, D] read [0, T) through
slice / permute / broadcast views, a bool mask [s, T] broadcast over the heads, T = p + s keys (``p``: the
past), with the mask an input so that any pattern (causal, a sliding window, random holes) can be fed.

A flash case's query rows sharing a K / V row are ``group · s``: not a static few, so codegen runs it as
flash attention (templates/flash_attention.cu).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker

S, P = Var("s"), Var("p")


@dataclass(frozen=True)
class FlashCase:
    """One attention: ``nkv`` K / V heads of ``group`` query heads, features ``d`` (q·k) and ``dv`` (v),
    ``mask`` one of causal | sliding | random (``window`` keys for sliding), the LLIR ``chunk``; ``pad``:
    the cache rows are stored ``pad`` elements longer than read (rows neither contiguous nor 16-byte
    aligned: the kernel's element-by-element copies)."""

    name: str
    nkv: int
    group: int
    d: int
    dv: int
    mask: str = "causal"
    window: int = 8
    chunk: int = 4096
    pad: int = 0


def flash_program(cases: list[FlashCase], dt: DType, max_t: int, out_dtype: DType = DType.f32) -> Program:
    """One program holding every case: inputs ``<case>.q / .k / .v / .mask``, output ``<case>.y`` (the
    combined attention, [nkv, group, s, dv] in ``out_dtype``)."""
    from lum.builder.extract import attention_ops

    ops: list[LOp] = []
    t = P + S
    outs = []
    for c in cases:
        nh, kd, vd = c.nkv * c.group, c.d + c.pad, c.dv + c.pad
        base = len(ops)
        ops += [LOp(base, "input", "Input", (), (as_expr(nh), S, as_expr(c.d)), dt,
                    {"name": f"{c.name}.q", "role": "input"}),
                LOp(base + 1, "input", "Input", (), tuple(map(as_expr, (max_t, c.nkv, kd))), dt,
                    {"name": f"{c.name}.k", "role": "input"}),
                LOp(base + 2, "input", "Input", (), tuple(map(as_expr, (max_t, c.nkv, vd))), dt,
                    {"name": f"{c.name}.v", "role": "input"}),
                LOp(base + 3, "input", "Input", (), (S, t), DType.bool, {"name": f"{c.name}.mask", "role": "input"})]

        def heads(width: int, stored: int) -> ShapeTracker:
            """Rows [0, T) of a [max_t, nkv, stored] cache, features [0, width), as [nkv, group, s, T, width]."""
            v = ShapeTracker.contiguous((max_t, c.nkv, stored)).slice(2, 0, width).slice(0, 0, t).permute((1, 0, 2))
            return v.expand_dim(1, c.group).expand_dim(2, S)

        q = ShapeTracker.contiguous((c.nkv, c.group, S, c.d))
        m = ShapeTracker.contiguous((S, t)).expand_dim(0, c.group).expand_dim(0, c.nkv)
        args = (Arg(base, q), Arg(base + 1, heads(c.d, kd)), Arg(base + 2, heads(c.dv, vd)), Arg(base + 3, m))
        att = attention_ops(args, c.d ** -0.5, dt, out_dtype, base + 4, c.chunk)
        ops += att
        outs.append((att[-1], f"{c.name}.y"))
    for lop, name in outs:
        ops.append(LOp(len(ops), "output", "Output", (Arg(lop.id, ShapeTracker.contiguous(lop.shape)),), lop.shape,
                       lop.dtype, {"name": name, "role": "output"}))
    return Program("flash", ops)


def flash_mask(case: FlashCase, s: int, p: int, rng: np.random.Generator) -> np.ndarray:
    """[s, p + s] bool: query i (position p + i) sees key j when j <= p + i (causal), and p + i - j < window
    (sliding); random: a causal mask with holes (every row keeps its diagonal)."""
    pos = p + np.arange(s)[:, None]
    key = np.arange(p + s)[None, :]
    m = key <= pos
    if case.mask == "sliding":
        m &= pos - key < case.window
    elif case.mask == "random":
        m &= rng.random(m.shape) < 0.6
        m[np.arange(s), p + np.arange(s)] = True
    return m


def flash_inputs(cases: list[FlashCase], dt: DType, max_t: int, s: int, p: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of every case at (s, p): never zero, K scaled up so the softmax is far from uniform."""
    rng = np.random.default_rng(seed)
    np_dt = ml_dtypes.bfloat16 if dt == DType.bf16 else dt.np
    out = {}
    for c in cases:
        nh = c.nkv * c.group

        def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
            x = rng.uniform(0.25, 1.5, shape) * rng.choice([-1.0, 1.0], shape) * scale
            return x.astype(np_dt)

        out[f"{c.name}.q"] = rand(nh, s, c.d)
        out[f"{c.name}.k"] = rand(max_t, c.nkv, c.d + c.pad, scale=2.0)
        out[f"{c.name}.v"] = rand(max_t, c.nkv, c.dv + c.pad)
        out[f"{c.name}.mask"] = flash_mask(c, s, p, rng)
    return out


def flash_reference(case: FlashCase, inputs: dict[str, np.ndarray], dt: DType) -> np.ndarray:
    """Softmax attention in float64, [nkv, group, s, dv], the probabilities rounded to ``dt`` before ·v
    (as the LLIR's p_dtype says) and normalised by their unrounded sum. One query head at a time, through
    matmul: all heads at once made llama3-1b's 4,096 x 6,144 case a 6 GB einsum that outlasted a GPU call."""
    q, k, v, mask = (inputs[f"{case.name}.{x}"] for x in ("q", "k", "v", "mask"))
    s, t = mask.shape
    qf = q.astype(np.float64).reshape(case.nkv, case.group, s, case.d)
    out = np.empty((case.nkv, case.group, s, case.dv))
    for h in range(case.nkv):
        kf = k[:t, h, :case.d].astype(np.float64)
        vf = v[:t, h, :case.dv].astype(np.float64)
        for g in range(case.group):
            logits = np.where(mask, (qf[h, g] @ kf.T) * case.d ** -0.5, -np.inf)
            e = np.exp(logits - logits.max(-1, keepdims=True))
            pr = e if dt == DType.f32 else e.astype(ml_dtypes.bfloat16 if dt == DType.bf16 else np.float16
                                                    ).astype(np.float64)
            out[h, g] = (pr @ vf) / e.sum(-1, keepdims=True)
    return out
