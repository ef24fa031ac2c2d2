"""Prefill time of a lum package against torch (Hugging Face transformers, sdpa attention), same weights, same run.

    python benchmarks/prefill.py --model gemma3-4b --dtype bf16 --prompt-len 2048 [--systems lum,hf-sdpa,hf-compile]
                                 [--warmup 3] [--repeats 10] [--max-seq N] [--out DIR] [--time-limit 220]
                                 [--workdir DIR --keep] [--hf-dir DIR] [--pkg FILE] [--commit SHA]

What it does, in one run on one GPU:

1. Makes a Hugging Face model of the named config with random weights on the GPU and saves it as an HF
   folder (as benchmarks/decode.py does); ``lum build <folder> --dtype D --max-seq N`` (N ≥ the prompt)
   turns it into the package, so both systems read identical weights. ``--hf-dir``/``--pkg`` reuse them
   (a reused package must have been built from that folder for the cross-check to mean anything).
2. Runs each system in its own subprocess (a crash or a timeout becomes that row's ``error``), on the same
   prompt of ``--prompt-len`` token ids, batch 1. Every call is "prompt ids on the host → logits of all
   rows computed on the device → the last row copied to the host"; that copy waits for the device, so the
   wall clock around one call is the prefill time. The first call is recorded apart (``cold_s``: CUDA-graph
   capture for lum, lazy kernel loading for torch, compilation for hf-compile), then ``--warmup`` untimed
   calls, then ``--repeats`` timed calls; rows report the median.
   * ``lum``: ``session(backend="cuda").run_device("prefill", {"tokens": ids}, {"s": n})["logits"].row(-1)``
     (its prefill also writes the KV cache).
   * ``lum-noflash``: the same, from a second package built with ``LUM_FLASH_ATTENTION=0`` (prefill's q·k and
     p·v as GEMMs with the scores in memory and a softmax row kernel, as before flash attention).
   * ``hf-sdpa``: ``AutoModelForCausalLM`` with ``attn_implementation="sdpa"``, ``model(input_ids,
     use_cache=False)`` under ``torch.no_grad()`` (cuBLAS GEMMs; SDPA calls without a mask may take the
     flash kernel, calls with an explicit mask — sliding-window layers once the prompt exceeds the window —
     cannot; ``details.sdpa_calls`` counts both kinds in one extra untimed call).
   * ``hf-compile``: the same forward under ``torch.compile(model.forward, dynamic=False)`` (inductor,
     no CUDA graphs); a failure or a timeout becomes its row's error.
3. Cross-checks lum's last-row logits against hf-sdpa's (relative L2 error, argmax agreement): information,
   not a failure.
4. Writes ``<out>/prefill-<model>-<dtype>-<date>.json`` (``commit gpu driver date config versions rows``;
   each row ``model dtype system prompt_len median_s tokens_per_s``, lum's with ``vs_torch`` = its median
   over hf-sdpa's) and prints a summary table.

The whole run stays under ``--time-limit`` seconds: workers get what is left of it, and a system that
would not fit is recorded as skipped. Bad arguments exit 2 with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (_graph_count, _hf_load, _named_config, _one_line,  # noqa: E402
                     add_run_args, build_package, log, make_hf_folder, new_record, prompt_ids, run_and_record, run_systems,
                     run_worker, run_worker_main, set_log_tag)

set_log_tag("prefill-bench")
SYSTEMS = ("lum", "lum-noflash", "hf-sdpa", "hf-compile")
LUM_BUILD_ENV = {"lum": {}, "lum-noflash": {"LUM_FLASH_ATTENTION": "0"}}   # lum systems: their build environment
# per-worker caps (the global limit wins)
CAP_S = {"lum": 120.0, "lum-noflash": 120.0, "hf-sdpa": 90.0, "hf-compile": 180.0}
BUILD_CAP_S = 150.0
DTYPES = ("bf16", "f32")                                        # what ``lum build --dtype`` takes
HF_CACHE = "none (use_cache=False)"


# ====================================================================== timing (inside the workers)
@dataclass
class Timing:
    """Seconds of the first call and of each timed call."""

    cold_s: float
    times_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"cold_s": round(self.cold_s, 6), "median_s": statistics.median(self.times_s),
                "min_s": min(self.times_s), "repeats": len(self.times_s),
                "times_s": [round(t, 6) for t in self.times_s]}


def time_prefill(call: Callable[[], object], spec: dict) -> tuple[Timing, object]:
    """One cold call, ``warmup`` untimed calls, then up to ``repeats`` timed calls, stopping early rather than
    run past the worker's budget. ``call`` must return only once the device is done (it copies a row back)."""
    deadline = spec.get("_t0", time.perf_counter()) + spec.get("budget_s", 1e9) - 5.0
    t = time.perf_counter()
    last = call()
    timing = Timing(time.perf_counter() - t)
    prev = timing.cold_s                  # the previous call's time: will the next one fit?
    for _ in range(spec["warmup"]):
        if time.perf_counter() + 2 * prev > deadline:
            break
        t = time.perf_counter()
        call()
        prev = time.perf_counter() - t
    for _ in range(spec["repeats"]):
        if timing.times_s and time.perf_counter() + 2 * prev > deadline:
            break
        t = time.perf_counter()
        last = call()
        prev = time.perf_counter() - t
        timing.times_s.append(prev)
    if not timing.times_s:
        raise RuntimeError(f"no timed call fitted in the worker's {spec.get('budget_s', 0):.0f} s")
    return timing, last


def _save_row(spec: dict, system: str, row) -> str:
    """The last logits row as float32 .npy in the work folder, for the parent's cross-check."""
    import numpy as np

    path = Path(spec["workdir"]) / f"logits-{system}.npy"
    np.save(path, np.asarray(row, dtype=np.float32).reshape(-1))
    return str(path)


# ====================================================================== workers (subprocesses)
def worker_lum(spec: dict) -> dict:
    import numpy as np

    import lum.loader

    t0 = time.perf_counter()
    pkg = lum.loader.open(spec["pkg"])
    t_open = time.perf_counter()
    sess = pkg.session(backend=spec.get("lum_backend", "cuda"))
    t_sess = time.perf_counter()
    tokens = np.asarray(spec["prompt"], np.int32)
    dyn = {"s": len(tokens)}
    on_device = sess.backend == "cuda"

    def call():
        if on_device:    # logits stay on the device; only the last row comes back (that copy synchronises)
            return sess.run_device("prefill", {"tokens": tokens}, dyn)["logits"].row(-1).numpy()
        return sess.run("prefill", {"tokens": tokens}, dyn)["logits"][-1]

    timing, last = time_prefill(call, spec)
    details = {"backend": sess.backend, "open_s": round(t_open - t0, 4), "session_s": round(t_sess - t_open, 4),
               "upload_GBps": sess.upload_gbps, "graphs": getattr(sess.runner, "graphs", None),
               "graph_error": getattr(sess.runner, "graph_error", None),
               "method": "session.run_device prefill, last logits row to the host" if on_device
               else "session.run prefill (all logits to the host)"}
    return {**timing.as_dict(), "logits_path": _save_row(spec, "lum", last), "details": details}


def _sdpa_calls(torch, call: Callable[[], object]) -> dict[str, int]:
    """SDPA calls of one forward by kind: no mask and ``is_causal`` (the flash kernel can take it), an explicit
    mask (it cannot: memory-efficient or math kernel), or neither."""
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention
    counts = {"causal_no_mask": 0, "explicit_mask": 0, "other": 0}

    def counting(*args, **kw):
        mask = kw.get("attn_mask", args[3] if len(args) > 3 else None)
        kind = "explicit_mask" if mask is not None else "causal_no_mask" if kw.get("is_causal") else "other"
        counts[kind] += 1
        return orig(*args, **kw)

    F.scaled_dot_product_attention = counting
    try:
        call()
    finally:
        F.scaled_dot_product_attention = orig
    return counts


def _worker_hf(spec: dict, compiled: bool) -> dict:
    import torch

    t0 = time.perf_counter()
    model = _hf_load(spec)
    t_load = time.perf_counter() - t0
    dev = spec.get("device", "cuda")
    fwd = torch.compile(model.forward, dynamic=False) if compiled else model.forward
    g0 = _graph_count(torch)

    def call():
        ids = torch.tensor([spec["prompt"]], device=dev)
        logits = fwd(input_ids=ids, use_cache=False).logits      # [1, s, vocab]: every row, as lum computes
        return logits[0, -1].float().cpu().numpy()              # the copy back waits for the device

    with torch.no_grad():
        timing, last = time_prefill(call, spec)
        details = {"load_s": round(t_load, 2), "cache": HF_CACHE,
                   "attn_implementation": getattr(model.config, "_attn_implementation", "?"),
                   "method": "model(input_ids, use_cache=False) under torch.no_grad(), last logits row to the host"}
        if compiled:
            details["method"] = "torch.compile(model.forward, dynamic=False); " + details["method"]
            details["graphs_compiled"] = _graph_count(torch) - g0 if g0 >= 0 else None
        else:
            details["sdpa_calls"] = _sdpa_calls(torch, call)
    system = "hf-compile" if compiled else "hf-sdpa"
    return {**timing.as_dict(), "logits_path": _save_row(spec, system, last), "details": details}


def worker_hf_sdpa(spec: dict) -> dict:
    return _worker_hf(spec, compiled=False)


def worker_hf_compile(spec: dict) -> dict:
    return _worker_hf(spec, compiled=True)


WORKERS = {"lum": worker_lum, "lum-noflash": worker_lum, "hf-sdpa": worker_hf_sdpa, "hf-compile": worker_hf_compile}


# ====================================================================== arguments
class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage block) and exits 2."""

    def error(self, message: str):
        sys.stderr.write(f"prefill.py: error: {message}\n")
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-4b", help="a lum named config (lum.builder.models.NAMED_CONFIGS)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (the prefill's dyn s)")
    ap.add_argument("--max-seq", type=int, default=None, help="package max_seq (default: the prompt length)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls after the cold one")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls (the row reports their median)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    add_run_args(ap, 220.0, "reuse this package (built from --hf-dir) instead of building one")
    args = ap.parse_args(argv)
    if args._worker:
        return args
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        ap.error(f"--systems: unknown {bad or 'empty list'}; choose from {', '.join(SYSTEMS)}")
    try:
        cfg = _named_config(args.model)
    except ValueError as exc:
        ap.error(f"--model: {exc}")
    if args.prompt_len < 1:
        ap.error(f"--prompt-len must be at least 1, not {args.prompt_len}")
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and args.prompt_len > limit:
        ap.error(f"--prompt-len {args.prompt_len} exceeds {args.model}'s max_position_embeddings {limit}")
    if args.max_seq is not None and args.max_seq < args.prompt_len:
        ap.error(f"--max-seq {args.max_seq} is below --prompt-len {args.prompt_len}")
    if args.warmup < 0 or args.repeats < 1:
        ap.error(f"--warmup must be ≥ 0 and --repeats ≥ 1 (got {args.warmup}, {args.repeats})")
    if args.time_limit <= 0:
        ap.error(f"--time-limit must be positive, not {args.time_limit}")
    if args.pkg and not Path(args.pkg).is_file():
        ap.error(f"--pkg {args.pkg}: no such file")
    if args.hf_dir and Path(args.hf_dir).exists() and not (Path(args.hf_dir) / "config.json").is_file():
        ap.error(f"--hf-dir {args.hf_dir} exists but holds no config.json")
    return args


# ====================================================================== main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        return run_worker_main(WORKERS, args._worker, args._spec, args._result)
    t_start = time.perf_counter()
    deadline = t_start + args.time_limit
    systems = args.systems
    max_seq = args.max_seq or args.prompt_len
    result, out_path, workdir = new_record(
        "prefill", args, {"model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
                          "max_seq": max_seq, "batch": 1, "warmup": args.warmup, "repeats": args.repeats,
                          "hf_cache": HF_CACHE, "logits": "all rows computed; the last row copied to the host",
                          "timing": "wall clock per call (host ids in → last logits row on the host), median"})
    rows = {s: {"model": args.model, "dtype": args.dtype, "system": s, "prompt_len": args.prompt_len,
                "median_s": None, "tokens_per_s": None, "cold_s": None, "error": None} for s in systems}
    for s in (s for s in LUM_BUILD_ENV if s in rows):
        rows[s]["vs_torch"] = None

    return run_and_record(result, rows, out_path, workdir, bool(args.keep or args.workdir), t_start, args.device,
                          lambda torch: _run(args, deadline, max_seq, rows, result, workdir), "median_s", print_table)


def _run(args, deadline: float, max_seq: int, rows: dict, result: dict, workdir: Path) -> None:
    # 1. the HF folder (the weights both systems read)
    hf_dir = Path(args.hf_dir) if args.hf_dir else workdir / "hf"
    if not (hf_dir / "config.json").exists():
        log(f"making a random {args.model} {args.dtype} HF model on the {args.device} → {hf_dir}")
        try:
            info = make_hf_folder(args.model, args.dtype, hf_dir, args.seed, args.device)
        except Exception as exc:  # noqa: BLE001
            log(traceback.format_exc())
            for r in rows.values():
                r["error"] = f"making the HF checkpoint failed: {_one_line(exc)}"
            return
        result["weight_bytes"] = info.pop("weight_bytes")
        result["timings_s"].update(info)

    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    vocab = int(getattr(hf_cfg, "vocab_size", None) or hf_cfg.get_text_config().vocab_size)
    spec = {"hf_dir": str(hf_dir), "dtype": args.dtype, "device": args.device, "workdir": str(workdir),
            "prompt": prompt_ids(vocab, getattr(hf_cfg, "bos_token_id", None), args.prompt_len),
            "warmup": args.warmup, "repeats": args.repeats, "lum_backend": args.lum_backend}

    # 2. the lum packages (lum-noflash: built with prefill's attention as GEMMs, the path before flash attention)
    pkgs: dict[str, str] = {}
    for s in (s for s in LUM_BUILD_ENV if s in rows):
        tag = s.removeprefix("lum")
        pkg = Path(args.pkg) if args.pkg and not tag else workdir / f"{args.model}-{args.dtype}-s{max_seq}{tag}.lumpkg"
        if not pkg.exists():
            log(f"lum build (max_seq {max_seq}{''.join(f', {k}={v}' for k, v in LUM_BUILD_ENV[s].items())}) → {pkg}")
            left = deadline - time.perf_counter()
            build_s, err = build_package(hf_dir, pkg, args.dtype, max_seq, result["target"],
                                         min(BUILD_CAP_S, left - 30), workdir / f"log-build{tag}.txt",
                                         env=LUM_BUILD_ENV[s])
            if err:
                rows[s]["error"] = err
                log(err)
            else:
                result["timings_s"]["lum_build" + tag.replace("-", "_")] = rows[s]["build_s"] = round(build_s, 1)
        if pkg.exists():
            pkgs[s] = str(pkg)
            rows[s]["package_bytes"] = pkg.stat().st_size

    # 3. the systems, each in its own process
    logits: dict[str, str] = {}
    ran = run_systems(rows, CAP_S, deadline, args.time_limit,
                      lambda s, timeout: run_worker(Path(__file__), s, {**spec, "pkg": pkgs.get(s)}, workdir, timeout))
    for s, res in ran.items():
        row = rows[s]
        med = res["median_s"]
        row.update(median_s=round(med, 6), tokens_per_s=round(args.prompt_len / med, 1), cold_s=res["cold_s"],
                   min_s=round(res["min_s"], 6), repeats=res["repeats"], details=res.get("details", {}))
        row["details"]["times_s"] = res["times_s"]
        logits[s] = res["logits_path"]
        log(f"{s}: median {med * 1e3:.2f} ms ({row['tokens_per_s']:.0f} tok/s), cold {res['cold_s']:.2f} s")

    # 4. lum against torch: time ratio and the last-row logits
    torch_s = rows.get("hf-sdpa", {}).get("median_s")
    for s in (s for s in LUM_BUILD_ENV if s in rows and rows[s]["median_s"] and torch_s):
        rows[s]["vs_torch"] = round(rows[s]["median_s"] / torch_s, 3)
        if rows.get("hf-compile", {}).get("median_s"):
            rows[s]["vs_hf_compile"] = round(rows[s]["median_s"] / rows["hf-compile"]["median_s"], 3)
    if "hf-sdpa" in logits:
        for s in logits:
            if s != "hf-sdpa":
                rows[s].update(_compare(logits[s], logits["hf-sdpa"]))


def _compare(path: str, ref_path: str) -> dict:
    """Relative L2 error of a last logits row against hf-sdpa's, and whether the argmax agrees."""
    import numpy as np

    a, b = np.load(path).astype(np.float64), np.load(ref_path).astype(np.float64)
    if a.shape != b.shape:
        return {"last_row_rel_err_vs_hf_sdpa": None, "argmax_matches_hf_sdpa": None,
                "compare_error": f"shapes differ: {a.shape} vs {b.shape}"}
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return {"last_row_rel_err_vs_hf_sdpa": float(f"{rel:.3e}"),
            "argmax_matches_hf_sdpa": bool(np.argmax(a) == np.argmax(b))}


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"\nprefill {cfg['model']} {cfg['dtype']} s={cfg['prompt_len']}  {result.get('gpu')}  "
          f"driver {result.get('driver')}  commit {str(result.get('commit'))[:12]}")
    print(f"{'system':<12} {'median ms':>10} {'tok/s':>10} {'cold s':>8} {'vs torch':>9}  note")
    for r in result["rows"]:
        ms = f"{r['median_s'] * 1e3:.2f}" if r.get("median_s") else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        cold = f"{r['cold_s']:.2f}" if r.get("cold_s") is not None else "-"
        vs = f"{r['vs_torch']:.2f}x" if r.get("vs_torch") else "-"
        note = r.get("error") or ""
        if not note and r.get("last_row_rel_err_vs_hf_sdpa") is not None:
            note = (f"last-row rel err {r['last_row_rel_err_vs_hf_sdpa']:.2e} vs hf-sdpa, argmax "
                    f"{'agrees' if r['argmax_matches_hf_sdpa'] else 'differs'}")
        print(f"{r['system']:<12} {ms:>10} {tps:>10} {cold:>8} {vs:>9}  {note[:150]}")


if __name__ == "__main__":
    sys.exit(main())
