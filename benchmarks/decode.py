"""Batch-1 greedy decode speed of a lum package against Hugging Face transformers, on the same weights.

    python benchmarks/decode.py --model gemma3-4b --dtype bf16 --steps 128 [--systems lum,hf-eager,hf-compile]
                                [--out DIR] [--prompt-len 16] [--warmup 16] [--max-seq 512] [--time-limit 470]
                                [--workdir DIR --keep] [--hf-dir DIR] [--pkg FILE] [--budget N]

What it does, in one run on one GPU:

1. Measures the device-to-device copy bandwidth (a 2 GiB torch copy, bytes read + written, median of 20).
2. Makes a Hugging Face model of the named config (``lum.builder.models.named_config``) with random weights,
   directly on the GPU (norms perturbed, other weights ×5 as tests/hf_checkpoints.py does, so tokens differ),
   and saves it as an HF folder. ``lum build <folder> --dtype D`` turns that folder into the package, so every
   system reads identical weights from disk.
3. Runs each system in its own subprocess (a crash or a missing backend becomes that row's ``error``):
   * ``lum``: ``lum.loader.open(pkg).session(backend="cuda")``; records package open → first token (prefill
     and argmax included); decode steps through ``sess.run("decode", …)`` (logits to the host, argmax
     there) and through the difference of two ``sess.generate`` calls, with its device loop (each step's
     input is the previous step's ``next_token`` output, no wait between steps, as the torch.compile loop
     below) and with ``device_loop=False``; the row's rate is the best of these (all in ``details``).
   * ``lum-serial``: the same package with every graph captured from one stream (``graph_branches=False``),
     to measure what parallel graph branches give, side by side; ``lum-graph-a-step`` with ``steps_per_graph=1``
     (generate launches a CUDA graph a decode step, as before step chains: loader/cuda/chain.py),
     ``lum-chain4`` / ``lum-chain16`` with 4 / 16 steps a graph (the default is 8).
   * ``lum-noprologue``: a second package built with ``LUM_GEMV_PROLOGUE=0`` (decode GEMVs read their
     input vectors from buffers; builder/prologue.py), to measure what GEMV prologues give, side by side;
     ``lum-noepilogue`` likewise with ``LUM_GEMV_EPILOGUE=0`` (builder/epilogue.py), ``lum-norowreads`` with
     ``LUM_ROW_READS=0`` (gemma's q / k norms stay kernels of their own; builder/row_reads.py), ``lum-inflight`` /
     ``lum-inflight8`` with ``LUM_GEMV_INFLIGHT=4`` / ``8`` (each GEMV lane issues that many weight loads
     before it uses any; templates/gemv.cu), ``lum-wideprologue`` with ``LUM_GEMV_PROLOGUE_MAX_COLS=32768``
     (gemma3-4b's gate-up GEMV computes its input norm too: one launch less a layer), ``lum-next`` with
     both ``LUM_GEMV_INFLIGHT=4`` and the wide prologue, ``lum-preload`` / ``lum-preload2`` /
     ``lum-preload4`` / ``lum-preload8`` with ``LUM_GEMV_PRELOAD=1`` / ``2`` / ``4`` / ``8`` (each GEMV lane
     loads its first weight vectors, up to that many, into registers before it waits for the kernel before
     it, which under programmatic launch still runs; templates/gemv.cu PRELOAD), ``lum-preload-aftergemv`` with ``LUM_GEMV_PRELOAD_AFTER_GEMV=4`` (only those
     whose kernel before is a GEMV, four vectors: the default since 2026-12-03), ``lum-nopreload`` with it at 0
     (no GEMV preloads, the default before), ``lum-twowaves`` with ``LUM_GEMV_PROLOGUE_ONE_WAVE=0`` (a prologue GEMV's
     grid sized to 2,048 threads an SM whatever its registers, as before 2026-12-02: builder/kernels.py),
     ``lum-noevict`` with ``LUM_GEMV_EVICT_FIRST=0`` (GEMVs load their weights without the L2 evict-first
     policy that keeps the small tensors each step rereads in L2: templates/common.cuh lum_load_stream),
     ``lum-nobalance`` with ``LUM_GEMV_BALANCE=0`` (a large GEMV keeps 512 threads even where its blocks
     fall unevenly on the SMs: builder/gemv_policy.py blocks_unbalanced), ``lum-row-phases`` with
     ``LUM_ROW_ONLINE=0`` (decode attention's combine visits its chunks once per row reduction, three times,
     not once with a running maximum: builder/row_codegen.py online_softmax_sum), ``lum-two-kernels`` with
     ``LUM_O_COMBINE=0`` (decode attention's combine and o as two kernels, not one split by head:
     builder/o_combine.py), ``lum-o-grouped`` with ``LUM_O_COMBINE=grouped`` (that kernel also for more heads
     than a cluster's blocks, consecutive heads a block: llama3-1b),
     ``lum-preload-plain`` the same package launched plainly, ``lum-plain`` the default package launched
     plainly (``programmatic_launch=False``), to measure what programmatic dependent launch gives;
     ``lum-nosiblings`` with ``LUM_SIBLING_KERNELS=0`` (independent small
     kernels in a row, the k / v / q stage after qkv, as kernels of their own rather than one launch:
     builder/siblings.py), ``lum-nostage`` with ``LUM_ATTENTION_STAGE=0`` (that stage as a kernel of its own
     rather than computed by the attention kernel: builder/attention_stage.py),
     ``lum-nopreload-shared`` with ``LUM_GEMV_PRELOAD_SHARED=0`` (GEMVs keep their early weights in registers, as
     before 2026-12-04; by default every GEMV behind a kernel that is not a GEMV, its grid one wave, copies every
     weight vector of its lanes' first column into shared memory before it waits: gemma3-4b's qkv 160 KB a
     block, its o and llama3-1b's o),
     ``lum-narrow-a`` with
     ``LUM_GEMV_PROLOGUE_NARROW_A=1`` (prologue GEMVs keep their bf16 A as bf16 in shared memory, half the bytes
     each warp reads; the default does only where their weights preload into shared memory), ``lum-wide-a``
     with ``LUM_GEMV_PROLOGUE_NARROW_A=0`` (none does),
     ``lum-prologue512`` and ``lum-prologue256`` with ``LUM_GEMV_PROLOGUE_THREADS`` (prologue GEMVs in blocks of
     512 or 256 threads, not 1,024), ``lum-unpaired`` with ``LUM_GEMV_PROLOGUE_PAIRS=0`` (one column a warp; by
     default every prologue GEMV without an epilogue computes two, 2026-12-04; ``lum-pairs``: only those whose
     weights preload into shared memory, ``=shared``), ``lum-lmhead-prologue`` with
     ``LUM_GEMV_PROLOGUE_MAX_COLS=131072`` (the LM head computes the final norm itself; on gemma3-4b its
     gate-up too), ``lum-down-inflight4`` with ``LUM_GEMV_TUNING=3.inflight=4`` (each layer's fourth GEMV, the
     down projection, loads 4 weight vectors a lane ahead), ``lum-ahead-plain`` with ``LUM_GEMV_AHEAD_PLAIN=1``
     (a GEMV without an epilogue or prologue loads all of a lane's few vectors ahead too: the LM heads, and
     llama3-1b's o), ``lum-after-gemv-off`` with ``LUM_GEMV_AHEAD_AFTER_GEMV=0`` (by default a GEMV behind a GEMV
     asks L2 for its first lines before its wait: gemma3-4b's down during gate-up's last wave),
     ``lum-gateup-inflight0`` / ``-inflight2`` / ``-inflight4`` / ``-inflight5`` / ``-unroll8`` / ``-threads256`` /
     ``-group32`` / ``-group128`` / ``-max_blocks1320`` / ``-max_blocks2640`` with
     ``LUM_GEMV_TUNING=2.<key>=<value>`` (each layer's third GEMV, gemma3-4b's gate-up, with that one parameter
     changed: at 2ea84da it streamed at 93% of the copy rate on the H200, 98% on the H100, benchmarks/NOTES.md
     2026-12-07; ``-inflight0`` is the compiler's loop it had before all five of a lane's vectors a column went
     ahead by default, gemv_policy.gemv_inflight_for),
     ``lum-chunk32`` / ``lum-chunk64`` with
     ``LUM_ATTENTION_CHUNK`` (decode attention in chunks of 32 / 64 keys, not 16), ``lum-norms-behind`` /
     ``lum-norms-ahead`` with ``LUM_NORMS_AHEAD=0`` / ``1`` (each decode layer's input norm as its qkv's
     prologue / at the end of the layer before: builder/models/transformer.py ``norms_ahead``; on by default for
     gemma3-4b, so ``lum-norms-ahead`` on llama3-1b is its qkv as a plain GEMV behind a norm kernel;
     ``lum-norms-ahead-noprologue`` with ``LUM_GEMV_PROLOGUE=0`` too: its gate-up also plain, 4,096 blocks of 128
     threads behind a residual-norm kernel, as gemma3-4b's layer is), ``lum-qkv1024``
     with ``LUM_GEMV_TUNING=0.threads=1024`` (gemma3-4b's plain qkv in 128 blocks of 1,024 threads, one an SM,
     160 KB preloaded each, as its prologue form had, not 256 of 512), ``lum-o-group32`` with
     ``LUM_GEMV_TUNING=1.group=32`` (o in 160 blocks, a warp a column, all 8 vectors of a lane preloaded,
     64 KB, not 320 blocks of 32 KB: fewer blocks to make resident beside the attention's), ``lum-lmhead-group32``
     with ``LUM_GEMV_TUNING=0.group=32`` (on gemma3-4b only its LM head changes, the first GEMV of its group, to
     32 threads a column: four columns a block, where its qkv already has 32);
     ``lum-tuned`` built by the measured search with ``--tuned-budget`` candidates a decode group (``lum build
     --tune decode``, lum.builder.tuning: each decode GEMV's block size, split, unroll, grid cap timed on the GPU;
     prefill keeps the cost model's choice).
   * ``hf-eager``: ``AutoModelForCausalLM.from_pretrained`` (sdpa attention), dynamic cache, a manual greedy loop.
   * ``hf-compile``: the same model with a static cache and ``torch.compile(model.forward,
     mode="reduce-overhead", fullgraph=True)`` (CUDA graphs); prefill eager, decode compiled, explicit
     position ids (and ``cache_position`` where the model's forward takes it). For Gemma 3 the sliding-window
     static layers are replaced by plain static layers while ``max_seq`` ≤ the window (same attention, since no
     position is past the window; transformers' sliding static layer keeps a Python int that makes
     ``torch.compile`` recompile every step). Recompiles during the timed steps are counted and reported.
   Every system: the same prompt ids, ``--warmup`` untimed decode steps, then ``--steps`` timed decode steps
   (wall clock between two device synchronisations), each step choosing the argmax token.
4. Writes ``<out>/decode-<model>-<dtype>-<date>.json``: ``commit``, ``gpu``, ``driver``, ``date``, ``copy_GBps``
   and ``rows`` (``model dtype system tok_per_s weight_bytes roofline_tok_per_s`` …; ``open_to_first_token_s``
   for lum). The roofline is ``copy_GBps·1e9 / weight_bytes``: a decode step reads every weight once;
   ``roofline_with_kv_tok_per_s`` also counts the K/V rows a step reads at the run's mean past length.
   ``copy_GBps`` is the faster of two copy measurements, before the systems and after them
   (``copy_GBps_first``, ``copy_GBps_last``): a first one taken low made every fraction look higher.

The whole run for gemma3-4b bf16 stays under ``--time-limit`` seconds (default 470, under 8 minutes on an
H200): workers get what is left of it, and a system that would not fit is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (TORCH_DTYPES, _graph_count, _hf_load, _one_line,  # noqa: E402
                     _sync, _sync_all, add_run_args, build_package, log, make_hf_folder, prompt_ids, new_record,
                     run_and_record, run_systems, run_worker_main, set_log_tag)
from _common import run_worker as _run_worker  # noqa: E402

set_log_tag("decode-bench")
LUM_BUILD_ENV = {"lum-noprologue": {"LUM_GEMV_PROLOGUE": "0"},     # systems whose package is built differently
                 "lum-noepilogue": {"LUM_GEMV_EPILOGUE": "0"}, "lum-norowreads": {"LUM_ROW_READS": "0"},
                 "lum-inflight": {"LUM_GEMV_INFLIGHT": "4"}, "lum-inflight8": {"LUM_GEMV_INFLIGHT": "8"},
                 "lum-wideprologue": {"LUM_GEMV_PROLOGUE_MAX_COLS": "32768"},
                 "lum-lmhead-prologue": {"LUM_GEMV_PROLOGUE_MAX_COLS": "131072"},
                 "lum-preload": {"LUM_GEMV_PRELOAD": "1"}, "lum-preload2": {"LUM_GEMV_PRELOAD": "2"},
                 "lum-preload4": {"LUM_GEMV_PRELOAD": "4"}, "lum-preload8": {"LUM_GEMV_PRELOAD": "8"},
                 "lum-preload-aftergemv": {"LUM_GEMV_PRELOAD_AFTER_GEMV": "4"},
                 "lum-nopreload": {"LUM_GEMV_PRELOAD_AFTER_GEMV": "0"},
                 "lum-twowaves": {"LUM_GEMV_PROLOGUE_ONE_WAVE": "0"},
                 "lum-noevict": {"LUM_GEMV_EVICT_FIRST": "0"}, "lum-nobalance": {"LUM_GEMV_BALANCE": "0"},
                 "lum-row-phases": {"LUM_ROW_ONLINE": "0"}, "lum-two-kernels": {"LUM_O_COMBINE": "0"},
                 "lum-o-grouped": {"LUM_O_COMBINE": "grouped"},
                 "lum-preload-plain": {"LUM_GEMV_PRELOAD": "1"},
                 "lum-down-inflight4": {"LUM_GEMV_TUNING": "3.inflight=4"},
                 "lum-ahead-plain": {"LUM_GEMV_AHEAD_PLAIN": "1"},
                 "lum-after-gemv-off": {"LUM_GEMV_AHEAD_AFTER_GEMV": "0"},
                 **{f"lum-gateup-{k}{v}": {"LUM_GEMV_TUNING": f"2.{k}={v}"}
                    for k, v in (("inflight", 0), ("inflight", 2), ("inflight", 4), ("inflight", 5), ("unroll", 8),
                                 ("threads", 256), ("group", 32), ("group", 128), ("max_blocks", 1320),
                                 ("max_blocks", 2640))},
                 "lum-norms-behind": {"LUM_NORMS_AHEAD": "0"}, "lum-norms-ahead": {"LUM_NORMS_AHEAD": "1"},
                 "lum-norms-ahead-noprologue": {"LUM_NORMS_AHEAD": "1", "LUM_GEMV_PROLOGUE": "0"},
                 "lum-qkv1024": {"LUM_GEMV_TUNING": "0.threads=1024"},
                 "lum-o-group32": {"LUM_GEMV_TUNING": "1.group=32"},
                 "lum-lmhead-group32": {"LUM_GEMV_TUNING": "0.group=32"},
                 "lum-chunk32": {"LUM_ATTENTION_CHUNK": "32"}, "lum-chunk64": {"LUM_ATTENTION_CHUNK": "64"},
                 "lum-nosiblings": {"LUM_SIBLING_KERNELS": "0"},
                 "lum-nostage": {"LUM_ATTENTION_STAGE": "0"},
                 "lum-nopreload-shared": {"LUM_GEMV_PRELOAD_SHARED": "0"},
                 "lum-narrow-a": {"LUM_GEMV_PROLOGUE_NARROW_A": "1"}, "lum-wide-a": {"LUM_GEMV_PROLOGUE_NARROW_A": "0"},
                 "lum-prologue512": {"LUM_GEMV_PROLOGUE_THREADS": "512"},
                 "lum-prologue256": {"LUM_GEMV_PROLOGUE_THREADS": "256"},
                 "lum-pairs": {"LUM_GEMV_PROLOGUE_PAIRS": "shared"}, "lum-unpaired": {"LUM_GEMV_PROLOGUE_PAIRS": "0"},
                 "lum-next": {"LUM_GEMV_INFLIGHT": "4", "LUM_GEMV_PROLOGUE_MAX_COLS": "32768"}}
TUNED_SYSTEMS = ("lum-tuned",)       # built by the measured search (--tuned-budget candidates a group)
LUM_OPTIONS = {"lum": {}, "lum-serial": {"graph_branches": False},                  # their session options
               "lum-plain": {"programmatic_launch": False},
               "lum-graph-a-step": {"steps_per_graph": 1}, "lum-chain4": {"steps_per_graph": 4},
               "lum-chain16": {"steps_per_graph": 16},
               **{s: {} for s in (*LUM_BUILD_ENV, *TUNED_SYSTEMS)}, "lum-preload-plain": {"programmatic_launch": False}}
SYSTEMS = (*LUM_OPTIONS, "hf-eager", "hf-compile")
CAP_S = {**{s: 120.0 for s in LUM_OPTIONS}, "lum": 200.0, "hf-eager": 150.0,
         "hf-compile": 330.0}                                                   # per worker (the limit wins)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in LUM_BUILD_ENV and s not in TUNED_SYSTEMS)
BUILD_CAP_S = 240.0
DISK_MARGIN = 2 << 30       # bytes left free beside a package about to be built (a 64 GiB disk holds 7 of gemma3-4b)


# ====================================================================== environment
def copy_bandwidth_GBps(torch, device: str = "cuda", nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written over the median time of ``reps`` copies (CUDA events)."""
    if device != "cuda":
        nbytes, reps = 2**28, 5
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(torch, device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return moved / med / 1e9


# ====================================================================== HF model on the GPU

# ====================================================================== workers (subprocesses)
def _argmax_last(x) -> int:
    """The argmax of the last row of a logits array: numpy, torch, DLPack or __cuda_array_interface__."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return int(np.argmax(x.reshape(-1, x.shape[-1])[-1]))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        if isinstance(x, torch.Tensor):
            t = x
        elif hasattr(x, "__dlpack__"):
            t = torch.from_dlpack(x)
        elif hasattr(x, "__cuda_array_interface__"):
            t = torch.as_tensor(x, device="cuda")
        else:
            t = None
        if t is not None:
            return int(t.reshape(-1, t.shape[-1])[-1].argmax())
    arr = np.asarray(x)
    return int(np.argmax(arr.reshape(-1, arr.shape[-1])[-1]))


def worker_lum(spec: dict) -> dict:
    import numpy as np

    try:
        import torch  # noqa: F401 - imported before the clock starts; used for device-array argmax
    except ImportError:
        pass
    import lum.loader

    prompt, warmup, steps = spec["prompt"], spec["warmup"], spec["steps"]
    out: dict = {"details": {}}
    t0 = time.perf_counter()
    pkg = lum.loader.open(spec["pkg"])
    t_open = time.perf_counter()
    sess = pkg.session(backend=spec.get("lum_backend", "cuda"), **spec.get("lum_options", {}))
    t_sess = time.perf_counter()
    out["details"]["backend"] = getattr(sess, "backend", "?")
    logits = sess.run("prefill", {"tokens": np.asarray(prompt, np.int32)}, {"s": len(prompt)})["logits"]
    tok = _argmax_last(logits)
    t_first = time.perf_counter()
    out["open_to_first_token_s"] = round(t_first - t0, 4)
    out["details"].update(open_s=round(t_open - t0, 4), session_s=round(t_sess - t_open, 4),
                          prefill_first_token_s=round(t_first - t_sess, 4))
    tokens = [tok]
    pos = len(prompt)
    rates = {}
    def run_steps(n: int) -> None:
        nonlocal tok, pos
        for _ in range(n):
            logits = sess.run("decode", {"tokens": np.asarray([tok], np.int32)}, {"p": pos})["logits"]
            tok = _argmax_last(logits)
            tokens.append(tok)
            pos += 1
        _sync_all()

    try:
        run_steps(warmup)
        t1 = time.perf_counter()
        run_steps(steps)
        t2 = time.perf_counter()
        rates["run_loop"] = steps / (t2 - t1)
        out["tokens"] = tokens
    except Exception as exc:  # noqa: BLE001 - generate() below may still work
        out["details"]["run_loop_error"] = _one_line(exc)
    # generate(): the session's own greedy loop (it may keep the argmax on the device). Its decode rate is
    # the difference of two calls that share the prefill and the warm-up steps, after a call as long as the
    # longer one has captured every CUDA graph they replay (a graph a new dyn bucket, or a step chain's).
    n0, n1 = warmup + 1, warmup + 1 + steps
    if "run_loop" in rates:
        _partial(spec, out, rates)     # kept if the worker is stopped during generate()
        left = spec.get("budget_s", 1e9) - (time.perf_counter() - spec.get("_t0", t0))
        if 2 * (n0 + 2 * n1) / rates["run_loop"] * 1.5 > left:
            out["details"]["generate_error"] = f"skipped: about {left:.0f} s left of the worker's time"
            n0 = None
    # generate() twice: its device loop (each step's input token is the previous step's next_token, no
    # wait between steps) and its host loop (device_loop=False: the last logits row back, argmax on the host)
    for key, device_loop in (("generate", True), ("generate_host", False)):
        try:
            if n0 is None:
                raise RuntimeError("skipped")
            sess.generate(prompt, n1, device_loop=device_loop)     # warm: every graph the timed calls replay
            _sync_all()
            ta = time.perf_counter()
            sess.generate(prompt, n0, device_loop=device_loop)
            _sync_all()
            tb = time.perf_counter()
            toks = sess.generate(prompt, n1, device_loop=device_loop)
            _sync_all()
            tc = time.perf_counter()
            rates[key] = steps / max((tc - tb) - (tb - ta), 1e-9)
            out["details"][f"{key}_tokens_equal_run_loop"] = (list(map(int, toks)) == out["tokens"]
                                                               if "tokens" in out else None)
            out.setdefault("tokens", list(map(int, toks)))
        except Exception as exc:  # noqa: BLE001
            out["details"].setdefault(f"{key}_error", _one_line(exc))
    if not rates:
        raise RuntimeError(f"no decode measurement worked: {out['details']}")
    return _finish_lum(out, rates)


def _finish_lum(out: dict, rates: dict) -> dict:
    best = max(rates, key=rates.get)
    out["tok_per_s"] = rates[best]
    out["details"].update({f"{k}_tok_per_s": round(v, 2) for k, v in rates.items()})
    out["details"]["method"] = {"run_loop": "session.run decode loop, host argmax each step",
                                "generate": "difference of two session.generate calls (device loop)",
                                "generate_host": "difference of two session.generate calls (host loop)"}[best]
    out["details"]["ms_per_step"] = round(1e3 / out["tok_per_s"], 4)
    return out


def _partial(spec: dict, out: dict, rates: dict) -> None:
    if spec.get("_result"):
        res = _finish_lum(json.loads(json.dumps(out)), dict(rates))
        res["details"]["partial"] = "the worker stopped before generate() was timed"
        Path(spec["_result"]).write_text(json.dumps(res))


def _cache_kw(model) -> tuple[str, bool]:
    """The name of the forward's cache argument (``cache`` in newer transformers, ``past_key_values`` before)
    and whether it takes ``cache_position``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return name, "cache_position" in params


def _out_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def worker_hf_eager(spec: dict) -> dict:
    import torch

    t0 = time.perf_counter()
    model = _hf_load(spec)
    t_load = time.perf_counter() - t0
    prompt, warmup, steps = spec["prompt"], spec["warmup"], spec["steps"]
    cname, _ = _cache_kw(model)
    dev = spec.get("device", "cuda")
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=dev)
        out = model(input_ids=ids, use_cache=True)
        cache = _out_cache(out)
        tok = out.logits[:, -1].argmax(-1)
        toks = [tok]

        def step(tok):
            o = model(input_ids=tok.view(1, 1), use_cache=True, **{cname: cache})
            return o.logits[:, -1].argmax(-1)

        for _ in range(warmup):
            tok = step(tok)
            toks.append(tok)
        _sync(torch, dev)
        t1 = time.perf_counter()
        for _ in range(steps):
            tok = step(tok)
            toks.append(tok)
        _sync(torch, dev)
        t2 = time.perf_counter()
    tps = steps / (t2 - t1)
    return {"tok_per_s": tps, "tokens": [int(t) for t in torch.cat(toks).tolist()],
            "details": {"load_s": round(t_load, 2), "ms_per_step": round(1e3 / tps, 4), "cache": type(cache).__name__,
                        "attn_implementation": getattr(model.config, "_attn_implementation", "?"),
                        "method": "manual greedy loop, dynamic cache, device argmax"}}


def _static_cache(model, max_len: int) -> tuple[object, str]:
    """A StaticCache; sliding-window layers become plain static layers while max_len <= the window."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:
        cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len,
                            device=model.device, dtype=model.dtype)
    layers = getattr(cache, "layers", None)
    window = getattr(model.config, "sliding_window", None)
    if not layers or not any(getattr(layer, "is_sliding", False) for layer in layers):
        return cache, "static"
    if window is None or max_len > window:
        return cache, "static with sliding layers (max_seq exceeds the window: expect recompiles)"
    from transformers.cache_utils import StaticLayer

    n = 0
    for i, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False):
            layers[i] = StaticLayer(max_cache_len=max_len)
            n += 1
    flags = cache.__dict__.get("is_sliding")
    if isinstance(flags, list):   # older transformers kept the per-layer flags in a list
        cache.__dict__["is_sliding"] = [False] * len(flags)
    return cache, f"static; {n} sliding layers as plain static layers (max_seq {max_len} <= window {window})"


def worker_hf_compile(spec: dict) -> dict:
    import torch

    t0 = time.perf_counter()
    model = _hf_load(spec)
    t_load = time.perf_counter() - t0
    prompt, warmup, steps, max_len = spec["prompt"], max(spec["warmup"], 4), spec["steps"], spec["max_seq"]
    cname, has_cp = _cache_kw(model)
    dev = spec.get("device", "cuda")
    cache, cache_note = _static_cache(model, max_len)
    positions = torch.arange(max_len, device=dev, dtype=torch.long)
    tok_buf = torch.zeros((1, 1), dtype=torch.long, device=dev)
    pos_buf = torch.zeros((1, 1), dtype=torch.long, device=dev)
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def kwargs(ids, pos_ids):
        kw = {"input_ids": ids, "position_ids": pos_ids, "use_cache": True, cname: cache}
        if has_cp:
            kw["cache_position"] = pos_ids.view(-1)
        return kw

    with torch.no_grad():
        n = len(prompt)
        out = model(**kwargs(torch.tensor([prompt], device=dev), positions[:n].view(1, n)))   # eager prefill
        tok = out.logits[:, -1].argmax(-1)
        toks = [tok]
        pos = n

        def step(tok, pos):
            tok_buf.copy_(tok.view(1, 1))
            pos_buf.copy_(positions[pos].view(1, 1))
            if mark is not None:
                mark()
            o = fwd(**kwargs(tok_buf, pos_buf))
            return o.logits[:, -1].argmax(-1)

        tc = time.perf_counter()
        for _ in range(warmup):
            tok = step(tok, pos)
            toks.append(tok)
            pos += 1
        _sync(torch, dev)
        t_compile = time.perf_counter() - tc
        g0 = _graph_count(torch)
        t1 = time.perf_counter()
        for _ in range(steps):
            tok = step(tok, pos)
            toks.append(tok)
            pos += 1
        _sync(torch, dev)
        t2 = time.perf_counter()
        g1 = _graph_count(torch)
    tps = steps / (t2 - t1)
    return {"tok_per_s": tps, "tokens": [int(t) for t in torch.cat(toks).tolist()],
            "details": {"load_s": round(t_load, 2), "compile_warmup_s": round(t_compile, 2),
                        "warmup_steps": warmup, "ms_per_step": round(1e3 / tps, 4), "cache": cache_note,
                        "graphs_compiled": g1, "recompiles_during_timing": (g1 - g0) if g0 >= 0 else None,
                        "attn_implementation": getattr(model.config, "_attn_implementation", "?"),
                        "cache_position_arg": has_cp,
                        "method": "torch.compile(model.forward, mode='reduce-overhead', fullgraph=True), "
                                  "static cache, manual greedy loop"}}


WORKERS = {**{s: worker_lum for s in LUM_OPTIONS}, "hf-eager": worker_hf_eager, "hf-compile": worker_hf_compile}


def run_worker(system: str, spec: dict, workdir: Path, timeout: float) -> dict:
    if system in LUM_OPTIONS:
        spec = {**spec, "lum_options": LUM_OPTIONS[system]}
    return _run_worker(Path(__file__), system, spec, workdir, timeout)


# ====================================================================== main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-4b", help="a lum named config (lum.builder.models.NAMED_CONFIGS)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=16, help="untimed decode steps before timing")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-seq", type=int, default=512, help="package max_seq and HF static cache length")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"comma-separated, of {', '.join(SYSTEMS)} (default: %(default)s; the others each build "
                         "a package of their own)")
    ap.add_argument("--budget", type=int, default=0, metavar="N",
                    help="lum build --budget N: measured search of N candidates per group (kernel tuning "
                         "per shape; needs the GPU, is slower to build); 0: the cost model")
    ap.add_argument("--tuned-budget", type=int, default=48, metavar="N",
                    help="the budget of system lum-tuned's build (the default package beside it keeps --budget)")
    add_run_args(ap, 470.0, "reuse this package instead of building one")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker_main(WORKERS, args._worker, args._spec, args._result)
    t_start = time.perf_counter()
    deadline = t_start + args.time_limit
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        sys.stderr.write(f"error: unknown systems {bad}; choose from {SYSTEMS}\n")
        return 2
    need = args.prompt_len + args.warmup + max(args.steps, 0) + 8
    max_seq = max(args.max_seq, need)
    result, out_path, workdir = new_record(
        "decode", args, {"model": args.model, "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
                         "budget": args.budget, "tuned_budget": args.tuned_budget,
                         "prompt_len": args.prompt_len, "max_seq": max_seq, "batch": 1, "greedy": True},
        copy_GBps=None)
    rows = {s: {"model": args.model, "dtype": args.dtype, "system": s, "tok_per_s": None, "weight_bytes": None,
                "roofline_tok_per_s": None, "error": None} for s in systems}
    for s in LUM_OPTIONS.keys() & rows.keys():
        rows[s]["open_to_first_token_s"] = None

    return run_and_record(result, rows, out_path, workdir, bool(args.keep or args.workdir), t_start, args.device,
                          lambda torch: _run(args, torch, result["target"], deadline, max_seq, systems, rows, result,
                                             workdir), "tok_per_s", print_table)


def _run(args, torch, target, deadline, max_seq, systems, rows, result, workdir) -> None:
    # 1. copy bandwidth
    t0 = time.perf_counter()
    copy = copy_bandwidth_GBps(torch, args.device)
    result["copy_GBps"] = round(copy, 1)
    result["timings_s"]["copy_bandwidth"] = round(time.perf_counter() - t0, 1)
    log(f"copy bandwidth {copy:.0f} GB/s (read + write)")

    # 2. the HF folder (the weights every system reads)
    hf_dir = Path(args.hf_dir) if args.hf_dir else workdir / "hf"
    weight_bytes = None
    try:
        if not (hf_dir / "config.json").exists():
            log(f"making a random {args.model} {args.dtype} HF model on the GPU → {hf_dir}")
            info = make_hf_folder(args.model, args.dtype, hf_dir, args.seed, args.device)
            weight_bytes = info.pop("weight_bytes")
            result["timings_s"].update(info)
        if weight_bytes is None:
            weight_bytes = _weight_bytes_from_config(hf_dir, args.dtype)
    except Exception as exc:  # noqa: BLE001
        log(traceback.format_exc())
        for r in rows.values():
            r["error"] = f"making the HF checkpoint failed: {_one_line(exc)}"
        return
    result["weight_bytes"] = weight_bytes

    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    vocab = int(getattr(hf_cfg, "vocab_size", None) or hf_cfg.get_text_config().vocab_size)
    # the K/V rows a timed step also reads (2 · layers · kv heads · head dim · the mean past length):
    # small at short prompts, a few % of the weights at thousands of tokens
    kv = _kv_bytes_per_step(hf_cfg.get_text_config(), args.dtype, args.prompt_len + args.warmup + args.steps / 2)
    if kv and weight_bytes:
        result["kv_bytes_per_step"] = kv
    _set_roofline(rows, result, copy, weight_bytes, kv)
    bos = getattr(hf_cfg, "bos_token_id", None)
    spec = {"hf_dir": str(hf_dir), "dtype": args.dtype, "prompt": prompt_ids(vocab, bos, args.prompt_len),
            "warmup": args.warmup, "steps": args.steps, "max_seq": max_seq, "device": args.device,
            "lum_backend": args.lum_backend}

    # 3. the lum packages (one per build environment: the default one serves lum and lum-serial)
    by_env: dict[tuple, list[str]] = {}        # (build environment, budget) -> the lum systems its package serves
    for s in LUM_OPTIONS:
        if s in rows:
            budget = args.tuned_budget if s in TUNED_SYSTEMS else args.budget
            by_env.setdefault((tuple(sorted(LUM_BUILD_ENV.get(s, {}).items())), budget), []).append(s)
    pkgs = {}
    pkg_bytes = weight_bytes or 0           # what one more package takes on the disk, about (the last one built)
    for (env_key, budget), names in by_env.items():
        lum_rows = [rows[s] for s in names]
        tag = "".join(f"-{k.lower()}{v}" for k, v in env_key) + (f"-budget{budget}" if budget != args.budget else "")
        pkg = Path(args.pkg) if args.pkg and not tag else workdir / f"{args.model}-{args.dtype}{tag}.lumpkg"
        free = shutil.disk_usage(workdir).free
        if not pkg.exists() and free < pkg_bytes + DISK_MARGIN:     # every package stays until the systems ran
            for r in lum_rows:
                r["error"] = (f"not built: {free / 1e9:.1f} GB free on the disk, a package takes about "
                              f"{pkg_bytes / 1e9:.1f} GB (fewer lum systems a run)")
            log(lum_rows[0]["error"])
            continue
        if not pkg.exists():
            left = deadline - time.perf_counter()
            log(f"lum build{' with ' + ' '.join(f'{k}={v}' for k, v in env_key) if env_key else ''}"
                f"{f' --budget {budget}' if budget else ''} → {pkg}")
            cap = left - 60 if budget else min(BUILD_CAP_S, left - 30)   # a measured search takes what is left
            build_s, err = build_package(hf_dir, pkg, args.dtype, max_seq, target, cap,
                                         workdir / f"log-build{tag}.txt", env=dict(env_key), budget=budget,
                                         tune="decode" if budget != args.budget else None)
            if err:
                for r in lum_rows:
                    r["error"] = err
                log(err)
            else:
                result["timings_s"]["lum_build" + tag.replace("-", "_")] = round(build_s, 1)
                lum_rows[0]["build_s"] = round(build_s, 1)
        if pkg.exists():
            pkg_bytes = pkg.stat().st_size
            for s in names:
                pkgs[s] = str(pkg)
                rows[s]["package_bytes"] = pkg_bytes

    # 4. the systems, each in its own process
    outputs = run_systems(rows, CAP_S, deadline, args.time_limit,
                          lambda s, timeout: run_worker(s, {**spec, "pkg": pkgs.get(s)}, workdir, timeout))
    for s, res in outputs.items():
        row = rows[s]
        row["tok_per_s"] = round(res["tok_per_s"], 2)
        if "open_to_first_token_s" in res:
            row["open_to_first_token_s"] = res["open_to_first_token_s"]
        row["details"] = res.get("details", {})
        log(f"{s}: {row['tok_per_s']} tok/s")

    # 5. the copy rate again, the roofline at the faster of the two (2026-12-05: 4,142 GB/s first in one run,
    # 4,250 in the next, which moved llama3-1b's fraction by two points at the same tok/s)
    last = copy_bandwidth_GBps(torch, args.device)
    result["copy_GBps_first"], result["copy_GBps_last"] = round(copy, 1), round(last, 1)
    _set_roofline(rows, result, max(copy, last), weight_bytes, kv)
    log(f"copy bandwidth {last:.0f} GB/s after the systems; the roofline takes {max(copy, last):.0f}")

    base = outputs.get("lum", {}).get("tokens")      # lum's variants change timing, not values: the same tokens
    for s, res in outputs.items():
        if s != "lum" and s in LUM_OPTIONS and base and res.get("tokens"):
            rows[s]["tokens_match_lum"] = _prefix(res["tokens"], base)
    ref = outputs.get("hf-eager", {}).get("tokens")
    if ref:
        for s, res in outputs.items():
            if s != "hf-eager" and res.get("tokens"):
                rows[s]["tokens_match_hf_eager"] = _prefix(res["tokens"], ref)
                rows[s]["tokens_compared"] = min(len(res["tokens"]), len(ref))


def _set_roofline(rows: dict, result: dict, copy: float, weight_bytes: int | None, kv: int | None) -> None:
    """``copy_GBps`` and each row's roofline at copy rate ``copy`` (GB/s): with and without the K/V rows a step
    reads, and its fraction where the row has a speed."""
    result["copy_GBps"] = round(copy, 1)
    roof = copy * 1e9 / weight_bytes if weight_bytes else None
    for r in rows.values():
        r["weight_bytes"] = weight_bytes
        r["roofline_tok_per_s"] = round(roof, 2) if roof else None
        if roof and kv:
            r["roofline_with_kv_tok_per_s"] = round(copy * 1e9 / (weight_bytes + kv), 2)
        if roof and r.get("tok_per_s"):
            r["fraction_of_roofline"] = round(r["tok_per_s"] / roof, 3)


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


def _kv_bytes_per_step(cfg, dtype: str, past: float) -> int | None:
    """Bytes of K and V a decode step reads at a mean past length ``past`` (None when the config does not
    say its heads)."""
    try:
        layers, kv_heads = int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", None)
                                                            or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    except (AttributeError, TypeError):
        return None
    return int(2 * layers * kv_heads * head_dim * past * (4 if dtype == "f32" else 2))


def _weight_bytes_from_config(hf_dir: Path, dtype: str) -> int:
    """Parameter bytes of an HF folder in ``dtype``: element counts from the safetensors headers (a tied
    weight is stored once) times the item size."""
    import struct

    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
    item = {"bf16": 2, "f16": 2, "f32": 4}[dtype]
    n = 0
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                n += (end - start) // sizes[info["dtype"]]
    return n * item


def print_table(result: dict) -> None:
    print(f"\n{result.get('gpu')}  driver {result.get('driver')}  copy {result.get('copy_GBps')} GB/s  "
          f"commit {str(result.get('commit'))[:12]}")
    print(f"{'system':<11} {'tok/s':>9} {'roofline':>9} {'frac':>6} {'open→1st':>9}  note")
    for r in result["rows"]:
        tps = f"{r['tok_per_s']:.1f}" if r.get("tok_per_s") else "-"
        roof = f"{r['roofline_tok_per_s']:.1f}" if r.get("roofline_tok_per_s") else "-"
        frac = f"{r['fraction_of_roofline']:.2f}" if r.get("fraction_of_roofline") else "-"
        o = f"{r['open_to_first_token_s']:.2f}s" if r.get("open_to_first_token_s") else "-"
        note = r.get("error") or ""
        if not note and "tokens_match_hf_eager" in r:
            note = f"tokens = hf-eager for {r['tokens_match_hf_eager']}/{r['tokens_compared']}"
        print(f"{r['system']:<11} {tps:>9} {roof:>9} {frac:>6} {o:>9}  {note[:150]}")


if __name__ == "__main__":
    sys.exit(main())
