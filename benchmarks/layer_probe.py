"""Whether a model's decode layers keep the bus busy across their dependencies as one persistent kernel.

    python benchmarks/layer_probe.py [--model gemma3-4b|llama3-1b] [--out DIR] [--layers N] [--keys 128]
                                     [--reps 10]

Why: a decode layer of lum's gemma3-4b takes ≈ 62 µs for 188.7 MB of weights (44.9 µs at the copy rate),
and the stamps put the excess where the bus idles: the chain of small kernels from qkv to gate-up (31.5 MB
in ≈ 17 µs) and each GEMV's ramp and drain. Every way of streaming the next GEMV's weights during that
chain tried so far ran as separate launches (a preload before the programmatic wait, a copy into shared
memory, an L2 prefetch) and could not reach past the kernel before. A persistent kernel whose producer
warp streams the weights in the order its block will use them, never waiting for a dependency, can: the
ring (5 stages of 40 KB an SM, 26 MB over 132 SMs, ≈ 6 µs of bus) fills while the consumers wait.

One launch runs ``--layers`` layers (the model's count by default; benchmarks/layer_probe.cu: qkv with its
input norm, a query head's attention over ``--keys`` cached keys on each of the first blocks, o, the
residual and norm, gate-up with h = g · 2σ(u), down, at the model's shapes; the weights of two layer-sized
sets alternating, so none is in L2). Modes:

* ``ahead``: the producer streams every stage as soon as the ring has room; ``ahead-2``: the same with a
  ring of 2 stages (what the ring's depth is worth);
* ``gated``: the producer waits for a GEMV's inputs before streaming its weights (the bus idles across each
  dependency, as it would across kernel boundaries with no preload);
* ``stream``: nobody waits (no dependency kept; values not checked): the ring's own rate over the same
  bytes and work, the floor for the other two;
* ``-async``: the same with the stages filled by the producer warp's 32 lanes, 16-byte ``cp.async`` each,
  rather than by one copy-engine request a stage (``cp.async.bulk``): an earlier probe moved 21 MB of
  bulk copies at ≈ 2 TB/s (16 GB/s an SM, NOTES.md), so the bulk engine may be what caps a ring.
* ``-reg``: no ring: 16 consumer warps, each loading its piece of a chunk (half a row) straight into
  registers as lum's GEMVs do, the next chunk's piece in flight during a chunk's dot (≈ 80 KB an SM);
  ``ahead-reg`` loads each GEMV's first piece before its wait, ``gated-reg`` after it. Both rings ran at
  62–65% of the copy rate even in ``stream`` (2026-12-05): whether registers feed a persistent layer faster.

Printed and saved (``<out>/layer-probe-<model>-<date>.json``): µs a layer, the rate over the weight bytes and its
fraction of the copy rate measured in the same run (a 2 GiB device copy, bytes read + written), each mode
against ``stream``, and for ``ahead`` and ``gated`` the largest error of each layer's two residual
increments against float64 (each from the GPU's own input to that layer; every buffer poisoned with NaN
first, so an unwritten or early-read value cannot pass) and whether any wait gave up (a bug, or blocks
not co-resident).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (ProbeDevice, add_record_args, bf16_bits, bf16_float, log, record_head, set_log_tag,  # noqa: E402
                     write_record)
from ffn_probe import unit_weights  # noqa: E402

set_log_tag("layer-probe")


@dataclass(frozen=True)
class Dims:
    """A model's decode layer, as layer_probe.cu's LpGemma / LpLlama: hidden size, q · k · v rows, q rows,
    head size, query and kv heads, FFN size; its kernels' suffix and its layer count."""
    tag: str
    k: int
    nqkv: int
    q: int
    hd: int
    heads: int
    kv_heads: int
    ff: int
    layers: int

    @property
    def act(self) -> int:
        """A layer's activations (LP_ACT): qkv, a, o, h, d."""
        return self.nqkv + self.q + self.k + self.ff + self.k

    def counters(self) -> list[int]:
        """Each counter's full count: qkv, attention, o, gate-up and down chunks (heads for the attention)."""
        return [self.nqkv // 8, self.heads, self.k // 8, self.ff // 4, self.k // 2]


MODELS = {"gemma3-4b": Dims("gemma", 2560, 4096, 2048, 256, 8, 4, 10240, 34),
          "llama3-1b": Dims("llama", 2048, 3072, 2048, 64, 32, 8, 8192, 16)}
MAX_WARPS = 16                             # layer_probe.cu LP_MAX_WARPS: sizes the partial sums
THREADS, STAGE_BYTES = 256 + 32, 40960     # a ring's kernels: 8 consumer warps and the producer
REG_THREADS = 32 * MAX_WARPS               # the register-fed kernels (lp_reg_*): 16 consumer warps
COUNTERS = 5
MODES = {"ahead": ("bulk_5", 0), "ahead-2": ("bulk_2", 0), "gated": ("bulk_5", 1),   # (kernel, LP_AHEAD ...)
         "stream": ("bulk_5", 2), "ahead-async": ("async_5", 0), "gated-async": ("async_5", 1),
         "stream-async": ("async_5", 2), "ahead-reg": ("reg_1", 0), "gated-reg": ("reg_1", 1),
         "stream-reg": ("reg_1", 2)}
CHECKED = ("ahead", "ahead-2", "gated", "ahead-async", "gated-async", "ahead-reg", "gated-reg")
MAX_KEYS = 1024
SETS = 2
EPS = 1e-6
TOLERANCE = 1e-4
COPY_BYTES = 2 << 30


def weight_set(rng, m: Dims, keys: int) -> dict[str, np.ndarray]:
    """One layer's weights (bf16 bits, row-major [rows, K]) and its cached keys and values ([kv head, key, d])."""
    cache = (m.kv_heads, keys, m.hd)
    shapes = {"qkv": (m.nqkv, m.k), "o": (m.k, m.q), "g": (m.ff, m.k), "u": (m.ff, m.k), "d": (m.k, m.ff)}
    return {**{name: unit_weights(rng, n, k) for name, (n, k) in shapes.items()},
            "kc": bf16_bits(rng.uniform(-np.sqrt(3), np.sqrt(3), cache).astype(np.float32)),
            "vc": bf16_bits(rng.uniform(-np.sqrt(3), np.sqrt(3), cache).astype(np.float32))}


def dense(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A weight set as float64 from its bfloat16 bits."""
    return {k: bf16_float(v).astype(np.float64) for k, v in s.items()}


def rms(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.mean(v * v) + EPS)


def attention_out(qkv: np.ndarray, w: dict[str, np.ndarray], m: Dims) -> np.ndarray:
    """Each query head's softmax(rms(q) · Kᵀ / √HD) · V over its kv head's cached keys, concatenated."""
    out, group = [], m.heads // m.kv_heads
    for h in range(m.heads):
        q = rms(qkv[h * m.hd:(h + 1) * m.hd])
        s = w["kc"][h // group] @ q / np.sqrt(m.hd)
        p = np.exp(s - s.max())
        out.append(p @ w["vc"][h // group] / p.sum())
    return np.concatenate(out)


def layer_increments(x: np.ndarray, x2: np.ndarray, w: dict[str, np.ndarray],
                     m: Dims) -> tuple[np.ndarray, np.ndarray]:
    """A layer's two residual increments in float64: rms(o) (x2 = x + it) from the layer's input x, and
    rms(d) (the next x = x2 + it) from the GPU's own x2, so that each is checked on its own."""
    o = w["o"] @ attention_out(w["qkv"] @ rms(x), w, m)
    xn2 = rms(x2)
    h = (w["g"] @ xn2) * 2.0 / (1.0 + np.exp(-np.clip(w["u"] @ xn2, -80.0, 80.0)))
    return rms(o), rms(w["d"] @ h)


def check(xs: np.ndarray, x2s: np.ndarray, sets: list[dict[str, np.ndarray]], m: Dims) -> tuple[float, bool]:
    """(the largest error of any layer's two increments relative to their largest value, all finite):
    xs holds each layer's input and the last layer's output, x2s each layer's x2 (float64)."""
    errs = []
    for layer in range(len(x2s)):
        first, second = layer_increments(xs[layer], x2s[layer], sets[layer % SETS], m)
        for got, want in ((x2s[layer] - xs[layer], first), (xs[layer + 1] - x2s[layer], second)):
            errs.append(float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    finite = bool(np.isfinite(xs).all() and np.isfinite(x2s).all())          # NaN stays NaN (fails)
    return (float(np.max(errs)) if finite else float("nan")), finite


def kernel_name(kind: str, m: Dims) -> str:
    """A layer_probe.cu entry: lp_<copy>_<stages>_<model> (kind: a MODES kernel, <copy>_<stages>)."""
    return f"lp_{kind}_{m.tag}"


def threads_of(kind: str) -> int:
    """A MODES kernel's block: a ring's kernels 8 consumer warps and the producer, ``reg`` 16 warps."""
    return REG_THREADS if kind.startswith("reg") else THREADS


def stages_of(kind: str) -> int:
    """The ring's stages of a MODES kernel (<copy>_<stages>)."""
    return int(kind.rsplit("_", 1)[1])


def smem_bytes(stages: int, m: Dims) -> int:
    """layer_probe.cu lp_smem_bytes: the ring, ys and xs, partial sums, the mbarriers."""
    return stages * STAGE_BYTES + (2 * m.k + 3 * MAX_WARPS) * 4 + 2 * stages * 8


def copy_GBps(dev, reps: int) -> float:
    """A device-to-device copy of 2 GiB: bytes read + written over the median time."""
    src, dst = dev.buffer(COPY_BYTES), dev.buffer(COPY_BYTES)
    t = dev.timed(lambda: dev.cu.call(dev.drv.cuMemcpyDtoDAsync, dst.ptr, src.ptr, COPY_BYTES, dev.stream.handle),
                  reps)
    return 2 * COPY_BYTES / t / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap)
    ap.add_argument("--model", choices=sorted(MODELS), default="gemma3-4b", help="whose layer shapes")
    ap.add_argument("--layers", type=int, default=None, help="layers in the launch (default: the model's)")
    ap.add_argument("--keys", type=int, default=128, help=f"cached keys each attention head reads (1-{MAX_KEYS})")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    m = MODELS[args.model]
    n = m.layers if args.layers is None else args.layers
    if n < 1 or not 1 <= args.keys <= MAX_KEYS or args.reps < 1:
        ap.error(f"--layers and --reps must be >= 1, --keys within 1-{MAX_KEYS}")
    dev = ProbeDevice("layer_probe.cu")
    cu = dev.cu
    grid = dev.info.multiprocessors
    rng = np.random.default_rng(0)
    sets = [weight_set(rng, m, args.keys) for _ in range(SETS)]
    dense_sets = [dense(s) for s in sets]
    bufs = [{k: dev.upload(v) for k, v in s.items()} for s in sets]
    order = ("qkv", "o", "g", "u", "d", "kc", "vc")                              # LP_W_*
    wp = dev.upload(np.array([bufs[s][k].ptr for s in range(SETS) for k in order], np.uint64))
    x0 = rng.standard_normal(m.k).astype(np.float32)
    x0_buf = dev.upload(x0)
    act = dev.buffer(n * m.act * 4)
    xout, x2out = dev.buffer((n + 1) * m.k * 4), dev.buffer((n + 1) * m.k * 4)   # x2out's last row: unused
    cnt, err = dev.buffer(n * COUNTERS * 4), dev.buffer(4)
    kernels = {}
    for kind in sorted({k for k, _ in MODES.values()}):
        name, smem = kernel_name(kind, m), smem_bytes(stages_of(kind), m)
        f = kernels[kind] = dev.module.function(name, smem)
        if cu.call(dev.drv.cuOccupancyMaxActiveBlocksPerMultiprocessor, f, threads_of(kind), smem) < 1:
            log(f"{name} does not fit an SM ({smem} bytes of shared memory)")
            return 1
    copy = copy_GBps(dev, args.reps)
    wbytes = sum(sets[0][k].nbytes for k in ("qkv", "o", "g", "u", "d"))
    results = {}
    for mode, (kind, code) in MODES.items():
        stages = stages_of(kind)
        cu.memset(err.ptr, 0, 4, dev.stream)
        params = dev.pack([wp.ptr, x0_buf.ptr, act.ptr, xout.ptr, x2out.ptr, cnt.ptr, err.ptr, n, args.keys, code])

        def rec(st, params=params, f=kernels[kind], smem=smem_bytes(stages, m), threads=threads_of(kind)) -> None:
            cu.memset(cnt.ptr, 0, n * COUNTERS * 4, st)
            cu.launch_kernel(f, (grid, 1, 1), (threads, 1, 1), smem, st, params)

        def checked(got, mode=mode) -> tuple[float, bool]:
            xs, x2s = got[0].reshape(n + 1, m.k), got[1].reshape(n + 1, m.k)[:n]
            if mode not in CHECKED:
                return float("nan"), bool(np.isfinite(xs).all())
            return check(xs, x2s, dense_sets, m)

        t, rel, finite = dev.chain(rec, (([act], n * m.act * 4), ([xout, x2out], (n + 1) * m.k * 4)),
                                   [xout, x2out], (n + 1) * m.k, None, args.reps, check=checked)
        dev.stream.synchronize()
        gave_up = bool(dev.read(err, 1, "uint32")[0])
        us = t / n * 1e6
        rate = wbytes / (us * 1e-6) / 1e9
        ok = not gave_up and (mode not in CHECKED or (finite and rel < TOLERANCE))
        results[mode] = {"kernel": kernel_name(kind, m), "threads": threads_of(kind), "stages": stages,
                         "smem": smem_bytes(stages, m),
                         "layer_us": round(us, 3), "weight_GBps": round(rate, 1),
                         "of_copy_rate": round(rate / copy, 4), "checked": mode in CHECKED,
                         "rel_err": rel if mode in CHECKED else None, "finite": finite, "wait_gave_up": gave_up,
                         "ok": ok}
    for mode, r in results.items():      # against the stream of the same copy kind
        fill = mode.rsplit("-", 1)[1] if mode.endswith(("-async", "-reg")) else None
        floor = results[f"stream-{fill}" if fill else "stream"]["layer_us"]
        r["vs_stream"] = round(r["layer_us"] / floor, 4)
        err_txt = f"rel err {r['rel_err']:.2e}" if r["checked"] else "not checked"
        log(f"{mode:12s} {r['layer_us']:8.2f} us a layer ({r['weight_GBps']:.0f} GB/s of weights, "
            f"{100 * r['of_copy_rate']:.1f}% of the copy rate, {r['vs_stream']:.3f}x stream)  {err_txt}  "
            f"ok={r['ok']}")
    log(f"copy rate {copy:.0f} GB/s; at it a layer's {wbytes / 1e6:.1f} MB take {wbytes / copy / 1e3:.2f} us")
    record = {**record_head("layer-probe", args.commit, dev.info.name), "model": args.model, "layers": n,
              "keys": args.keys, "grid": grid, "stage_bytes": STAGE_BYTES,
              "weight_bytes_a_layer": wbytes, "copy_GBps": round(copy, 1), "modes": results}
    log(f"wrote {write_record(record, args.out, f'layer-probe-{args.model}')}")
    dev.close()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
