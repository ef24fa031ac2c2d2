"""Where a lum decode step (or a prefill) spends its time: every kernel of the captured graph, timed by CUPTI.

    python benchmarks/profile_decode.py --model gemma3-4b --dtype bf16 [--steps 20] [--prompt-len 16]
                                        [--out DIR] [--pkg FILE] [--max-seq 512] [--top 40] [--plain]
                                        [--entry prefill]

Builds the package the way ``decode.py`` does (random HF weights saved as a folder, ``lum build``), or takes
``--pkg``. Opens a CUDA session, runs the prompt and some warm-up decode steps, then profiles ``--steps`` decode
steps with ``torch.profiler`` (CUPTI sees the kernels of lum's CUDA graphs, whichever context launched them).
The steps loop as ``Session.generate`` does: each step's ``next_token`` output is the next step's input, on
the device, when the package has it (``loop`` in the record), else the host takes the logits' argmax.

Each kernel name maps back to its LLIR op (kind, op, shape, the cost model's bytes at this ``p``), so a row says
how long the kernel ran, how many bytes it moved and at what rate. The summary splits the step's wall time into
kernel time and the rest (launch gaps between graph nodes, host work): the two things fusion and better
kernels each reduce; ``idle_us_per_step`` and ``idle_gaps`` say where nothing at all ran on the device
(:func:`idle_gaps`: e.g. between two steps' graphs). Writes ``<out>/profile-decode-<model>-<dtype>-<date>.json``
(``…-plain.json`` with ``--plain``). Its loop runs a graph a step: a ``generate`` runs several steps a graph
(loader/cuda/chain.py), which this profile does not show.

``--entry prefill`` profiles ``--steps`` prefills of the ``--prompt-len`` prompt instead (``profile-prefill-…``;
``--max-seq`` grows to the prompt): flash attention's kernels against the GEMMs, softmax and scores of a
package built with ``LUM_FLASH_ATTENTION=0``. cuBLASLt's GEMMs show as kind ``library``.

Under programmatic launch (the default) a kernel starts while the one before it runs and waits for it on
the device, so its CUPTI duration includes that wait: kernel times overlap and their sum exceeds the
step. ``--plain`` launches plainly (``programmatic_launch=False``), for per-kernel times that add up. Either
way each row also says how far its launches push the step's timeline on (``advance_us_per_launch``,
:func:`critical_advance`): under programmatic launch, what a kernel really costs the step.

``--stamps`` builds the package with ``LUM_STAMPS=1`` (or takes a ``--pkg`` built so) and, after the warm-up, runs
one step whose kernels stamp, block by block, when a block started and when its wait for the kernel before
returned (templates/common.cuh "stamps"; 32 evenly spaced blocks a kernel, each kernel's last launch of the
step, so a decoder layer's kernels come from its last layer): :func:`stamp_timeline` orders them into
``…-stamps.json``. Under programmatic launch it says what CUPTI cannot: how long before its wait returned a
kernel's blocks were resident (what a preload had to stream in), and how long after the wait of one kernel
the next one's wait returned (its work after the wait plus the dependency's round trip). ``--stamp-steps N``
stamps N steps in a row: the record adds each step's links and, for the kernels with marks of their own (decode
attention), each sampled block's phases over the steps and which blocks trail (:func:`stamp_blocks`). Inlined,
the stamps cost registers: gemma3-4b's gate-up with its loads ahead took 117 stamped against 96 (4 blocks an SM,
not 5), and its stamped layers ran slower than the loop's where every timed run had them faster (f74fe96,
NOTES.md). The stamp is now a call (templates/common.cuh), and every decode kernel of gemma3-4b and llama3-1b
holds as many blocks an SM stamped as not; ``kernel_sizes.py --stamps`` checks a changed kernel.

``--ncu`` marks one step, after the warm-up, for Nsight Compute's hardware counters and writes no record:
``ncu --profile-from-start off -k regex:^lum_ -c N [--section …] -o REP python benchmarks/profile_decode.py
--ncu …`` profiles that step's first N lum kernels, each graph node on its own (``--clock-control none``
leaves the clocks alone, as the device notes ask).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from lum.builder.codegen import STAMP_FIELDS, stamp_tag

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (build_package, gpu_and_target, log, make_hf_folder, new_record, prompt_ids,
                     set_log_tag, unused_path)  # noqa: E402

set_log_tag("profile-decode")


def kernel_ops(pkg, entry: str, dyn: dict[str, int]) -> dict[str, dict]:
    """Kernel name -> its op (kind, op, shape, dtype) and the bytes it moves per launch at ``dyn``; a GEMV
    with a fused prologue / epilogue is op ``Gemm+prologue`` / ``Gemm+epilogue`` / both; a kernel that runs
    other ops too (builder/fused.py: siblings, an attention stage) adds ``+tail(<their ops>)``."""
    out: dict[str, dict] = {}
    for call in pkg.entry(entry).calls:
        table = pkg.manifest.groups[call.group].table
        if table is None:
            continue
        prog = pkg._program(call.group)
        by_id = {o.id: o for o in prog.ops}
        for k in table.ops:
            op = by_id[k.op]
            fused = [name for name, key in (("prologue", "expr"), ("epilogue", "epilogue"))
                     if op.kind == "gemm" and key in op.params]           # a GEMV computing its input / reader
            fused += [f"tail({','.join(by_id[t].op for t in k.tail)})"] if k.tail else []   # the other ops it runs
            info = out.setdefault(k.name, {
                "kind": op.kind, "op": "+".join([op.op, *fused]), "dtype": op.dtype.value,
                "shape": [str(d) for d in op.shape], "calls": 0,
                "bytes": sum(int(by_id[i].bytes.evaluate(dyn)) for i in (k.op, *k.tail))})
            info["calls"] += 1
            for lc in k.launches:
                out.setdefault(lc.kernel, info)
    return out


def critical_advance(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Kernel name -> the time its launches extend the step's timeline: with kernels in start order, each adds
    how far its end passes the latest end before it (0 when it ends inside another's span). Under programmatic
    launch a kernel starts while the one before it runs, so its duration is not what it costs the step; this is.
    The advances sum to the time some kernel is running, the step less its idle gaps. ``spans``: (name, start,
    end), any time unit."""
    out: dict[str, float] = defaultdict(float)
    latest = None
    for name, start, end in sorted(spans, key=lambda x: (x[1], x[2])):
        gain = end - (start if latest is None else max(latest, start))
        out[name] += max(0.0, gain)
        latest = end if latest is None else max(latest, end)
    return dict(out)


def idle_gaps(spans: list[tuple[str, float, float]], top: int = 8) -> list[dict]:
    """Where nothing runs on the device: each gap between the latest end so far and the next span's start,
    summed by (the span that ended last, the span that starts), the ``top`` largest first. A decode step's
    kernels overlap under programmatic launch, so what is left are the boundaries nothing overlaps: between
    two graph launches (the step's copies, the graph's own start) and any plain launch inside a step."""
    total: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    latest, last_name = None, None
    for name, start, end in sorted(spans, key=lambda x: (x[1], x[2])):
        if latest is not None and start > latest:
            t = total[(last_name, name)]
            t[0] += start - latest
            t[1] += 1
        if latest is None or end >= latest:
            latest, last_name = end, name
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"after": a, "before": b, "us": round(v[0], 2), "count": v[1]} for (a, b), v in rows]


def _kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device kernel the profiler saw."""
    spans = set()                # once each, however the profiler nests them
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).endswith("CUDA") and getattr(evt, "time_range", None) is not None:
            tr = evt.time_range
            if tr.end > tr.start:
                spans.add((evt.key, float(tr.start), float(tr.end)))
    return sorted(spans)


def stamp_timeline(records: list[np.ndarray], names: dict[int, str]) -> list[dict]:
    """Kernels in the order of their first block's start, each with its sampled blocks' start and wait-return
    times in µs from the earliest start: ``records`` are the modules' ``lum_stamps`` arrays (uint64, fields of
    codegen.STAMP_FIELDS: tag, block, SM, start ns, waited ns), ``names`` maps codegen.stamp_tag to kernel
    names. A kernel that never waited (no wait stamp) has ``waited_*`` None. ``link_us``: from its wait's first
    return to the next one's among the kernels (its work after the wait, its grid's drain and the next kernel's
    wait: the links sum to the step), None for the last and for a kernel that never waited."""
    by_kernel: dict[int, list[np.ndarray]] = defaultdict(list)
    for arr in records:
        for rec in np.asarray(arr, np.uint64).reshape(-1, STAMP_FIELDS):
            if rec[0] and rec[3]:
                by_kernel[int(rec[0])].append(rec)
    if not by_kernel:
        return []
    t0 = min(int(r[3]) for recs in by_kernel.values() for r in recs)
    rows = []
    for tag, recs in by_kernel.items():
        start = sorted((int(r[3]) - t0) / 1e3 for r in recs)
        waited = sorted((int(r[4]) - t0) / 1e3 for r in recs if r[4])
        marks = [sorted((int(r[5 + e]) - t0) / 1e3 for r in recs if r[5 + e]) for e in range(STAMP_FIELDS - 5)]
        rows.append({"kernel": names.get(tag, f"tag {tag:x}"), "blocks_sampled": len(recs),
                     "sms": len({int(r[2]) for r in recs}),
                     "start_us": [round(start[0], 3), round(start[len(start) // 2], 3), round(start[-1], 3)],
                     "waited_us": [round(waited[0], 3), round(waited[len(waited) // 2], 3), round(waited[-1], 3)]
                     if waited else None,
                     **({"marks_us": [[round(m[0], 3), round(m[len(m) // 2], 3), round(m[-1], 3)] if m else None
                                      for m in marks]} if any(marks) else {})})
    chain = sorted((r for r in rows if r["waited_us"]), key=lambda r: r["waited_us"][0])
    for r in rows:
        r["link_us"] = None
    for r, nxt in zip(chain, chain[1:]):
        r["link_us"] = round(nxt["waited_us"][0] - r["waited_us"][0], 3)
    rows.sort(key=lambda r: r["start_us"][0])
    return rows


def stamp_blocks(steps: list[list[np.ndarray]], names: dict[int, str]) -> dict[str, list[dict]]:
    """Kernel name -> its sampled blocks over several stamped steps, for the kernels with marks of their own
    (LUM_STAMP_AT: decode attention's stage, keys and stores). ``steps``: each step's records, as
    :func:`stamp_timeline` takes them (one array a module: a module's records are its kernel's last launch in
    it, so each module gives one layer). A row a (module, block): its SM each step, the medians over steps of
    its wait's return and of each mark, in µs after the earliest wait among the module's blocks that step
    (``waited_us``, ``marks_us``), how far its last mark trails the module's first block to finish
    (``behind_us``), and in how many steps it finished last (``last``). Which blocks trail, and whether it is
    the same ones every step (the block that writes the new kv row, those beside another kernel's copies), is
    what the one-step timeline cannot say."""
    per: dict[tuple[int, int, int], list[tuple[int, int, np.ndarray]]] = defaultdict(list)
    for s, records in enumerate(steps):
        for m, arr in enumerate(records):
            for rec in np.asarray(arr, np.uint64).reshape(-1, STAMP_FIELDS):
                if rec[0] and rec[3] and rec[4] and any(rec[5:]):
                    per[(int(rec[0]), m, s)].append((int(rec[1]), int(rec[2]), rec[4:].astype(np.int64)))
    rows: dict[tuple[int, int, int], dict] = {}
    for (tag, m, s), recs in sorted(per.items()):
        w0 = min(int(t[0]) for _, _, t in recs)
        ends = {b: max(int(x) for x in t if x) for b, _, t in recs}
        first_end = min(ends.values())
        last_block = max(ends, key=ends.get)
        for b, sm, t in recs:
            row = rows.setdefault((tag, m, b), {"module": m, "block": b, "sms": [], "_w": [], "_m": [], "_b": [],
                                                "last": 0})
            row["sms"].append(sm)
            row["_w"].append((int(t[0]) - w0) / 1e3)
            row["_m"].append([(int(x) - w0) / 1e3 if x else np.nan for x in t[1:]])
            row["_b"].append((ends[b] - first_end) / 1e3)
            row["last"] += b == last_block
    out: dict[str, list[dict]] = defaultdict(list)
    for (tag, _, _), row in sorted(rows.items()):
        marks = np.asarray(row.pop("_m"), float)
        row["waited_us"] = round(float(np.median(row.pop("_w"))), 3)
        row["marks_us"] = [round(float(np.median(col[~np.isnan(col)])), 3) if (~np.isnan(col)).any() else None
                           for col in marks.T]
        row["behind_us"] = round(float(np.median(row.pop("_b"))), 3)
        out[names.get(tag, f"tag {tag:x}")].append(row)
    return dict(out)


def _read_stamps(sess, zero: bool = False) -> list[np.ndarray]:
    """Every loaded module's ``lum_stamps`` array (zeroed instead when ``zero``); none in a package built
    without ``LUM_STAMPS=1``."""
    from lum.loader.cuda.driver import CudaError, call, drv

    out = []
    for mod in sess.runner.modules.values():
        try:
            ptr, nbytes = call(drv.cuModuleGetGlobal, mod.handle, b"lum_stamps")
        except CudaError:
            continue
        if zero:
            call(drv.cuMemsetD8, ptr, 0, nbytes)
            call(drv.cuCtxSynchronize)
            continue
        host = np.zeros(int(nbytes) // 8, np.uint64)
        call(drv.cuMemcpyDtoH, host.ctypes.data, ptr, nbytes)
        out.append(host)
    return out


def _device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-4b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--pkg", default=None, help="profile this package instead of building one")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--workdir", default=None,
                    help="where the HF folder and the package go, kept (default: a temp dir, removed at the end)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--top", type=int, default=40, help="kernels printed (all are saved)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true", help="launch plainly (no programmatic dependent launch)")
    ap.add_argument("--ncu", action="store_true",
                    help="run one step between cudaProfilerStart / Stop for Nsight Compute and write no record")
    ap.add_argument("--stamps", action="store_true",
                    help="build with LUM_STAMPS=1 and record when each kernel's blocks start and finish waiting "
                         "in one step (…-stamps.json)")
    ap.add_argument("--stamp-steps", type=int, default=1,
                    help="with --stamps: stamp this many steps, one after another; the timeline is the first's, "
                         "the record adds each step's links and, for kernels with marks of their own, every "
                         "sampled block's phases over the steps (stamp_blocks)")
    ap.add_argument("--entry", default="decode", choices=("decode", "prefill"),
                    help="what --steps runs: decode steps after the prompt, or prefills of the prompt")
    args = ap.parse_args(argv)
    made = args.workdir is None       # its own temp folder (an HF folder and a package: twice the weights) goes
    if made:                          # at the end, as decode.py's does, or a device's disk fills in a few runs
        args.workdir = tempfile.mkdtemp(prefix="lum-profile-")
    try:
        return _profile(args)
    finally:
        if made:
            shutil.rmtree(args.workdir, ignore_errors=True)


def _profile(args) -> int:
    """:func:`main` after its arguments: build (unless ``--pkg``), run and write the record."""
    if args.entry == "prefill":
        args.max_seq = max(args.max_seq, args.prompt_len)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import lum.loader

    torch.cuda.init()
    result, out_path, workdir = new_record(f"profile-{args.entry}", args, {
        "model": args.model, "dtype": args.dtype, "steps": args.steps, "prompt_len": args.prompt_len,
        "max_seq": args.max_seq, "entry": args.entry})
    if args.plain:                  # beside a profile of the same package under programmatic launch, not over it
        out_path = out_path.with_name(f"{out_path.stem}-plain.json")
    if args.stamps:
        out_path = out_path.with_name(f"{out_path.stem}-stamps.json")
    out_path = unused_path(out_path)                  # a second run the same day keeps the first's record
    result["gpu"], target = gpu_and_target(torch, "cuda")
    pkg_path = Path(args.pkg) if args.pkg else workdir / "model.lumpkg"
    if not args.pkg:
        hf = workdir / "hf"
        result["weight_bytes"] = make_hf_folder(args.model, args.dtype, hf, args.seed)["weight_bytes"]
        torch.cuda.empty_cache()
        dt, err = build_package(hf, pkg_path, args.dtype, args.max_seq, target, 900, workdir / "build.log",
                                env={"LUM_STAMPS": "1"} if args.stamps else None)   # codegen.module_source
        if err:
            raise SystemExit(err)
        result["timings_s"]["build"] = round(dt, 2)
    pkg = lum.loader.open(pkg_path)
    vocab = int(pkg.entry("decode").outputs[0].shape[-1].evaluate({}))
    sess = pkg.session(backend="cuda", programmatic_launch=not args.plain)
    result["programmatic_launch"] = bool(sess.runner.programmatic)
    prompt = prompt_ids(vocab, None, args.prompt_len)
    # the loop Session.generate runs: next_token fed back on the device when the package has it (no host
    # round trip per step), else the logits' argmax on the host
    device_loop = "next_token" in {o.name for o in pkg.entry("decode").outputs}
    result["loop"] = "device (next_token)" if device_loop else "host (logits argmax)"

    def next_input(out: dict):
        """The next step's ``tokens``: its ``next_token`` on the device, or the last logits row's argmax."""
        if device_loop:
            return out["next_token"]
        lg = out["logits"].numpy()
        return np.asarray([int(np.argmax(lg.reshape(-1, lg.shape[-1])[-1]))], np.int32)

    prompt_in = {"tokens": np.asarray(prompt, np.int32)}
    tok = next_input(sess.run_device("prefill", prompt_in, {"s": len(prompt)}))
    pos = len(prompt)

    def steps(n: int) -> float:
        nonlocal tok, pos
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            if args.entry == "prefill":               # the same prompt again: its cache rows are rewritten
                sess.run_device("prefill", prompt_in, {"s": len(prompt)})
                continue
            tok = next_input(sess.run_device("decode", {"tokens": tok}, {"p": pos}))
            pos += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    steps(args.warmup)
    if args.ncu:                                      # the step ncu --profile-from-start off profiles
        torch.cuda.profiler.start()
        steps(1)
        torch.cuda.profiler.stop()
        log("ran one step for Nsight Compute; no record written")
        return 0
    if args.stamps:                                   # one step's kernels, block by block
        if not _read_stamps(sess):
            raise SystemExit(f"error: {pkg_path} was not built with LUM_STAMPS=1 (no lum_stamps in its modules)")
        names = {stamp_tag(name): name for name in kernel_ops(pkg, args.entry, {"p": pos})}
        stamped, first_p = [], pos
        for _ in range(max(1, args.stamp_steps)):
            _read_stamps(sess, zero=True)
            steps(1)
            stamped.append(_read_stamps(sess))
        timelines = [stamp_timeline(records, names) for records in stamped]
        timeline = timelines[0]
        ops = kernel_ops(pkg, args.entry, {"p": first_p})
        for r in timeline:
            info = ops.get(r["kernel"], {})
            r.update({"kind": info.get("kind"), "op": info.get("op"), "shape": info.get("shape")})
        result.update({"p": first_p, "programmatic_launch": bool(sess.runner.programmatic), "timeline": timeline})
        if len(stamped) > 1:
            links: dict[str, list] = defaultdict(list)
            for rows in timelines:
                for r in rows:
                    links[r["kernel"]].append(r["link_us"])
            result.update({"stamp_steps": len(stamped), "links_us_by_step": dict(links),
                           "blocks": stamp_blocks(stamped, names)})
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
        print(f"  {'start µs (min / median / max)':>30}  {'waited µs (min / median / max)':>30}  link µs  blocks  "
              "kernel")
        for r in timeline:
            w = "/".join(f"{x:.2f}" for x in r["waited_us"]) if r["waited_us"] else "-"
            link = f"{r['link_us']:.2f}" if r["link_us"] is not None else "-"
            what = f"{r['kind']}/{r['op']} {r['shape']}" if r["kind"] else "  " + r["kernel"].split(" ", 1)[-1]
            print(f"  {'/'.join(f'{x:.2f}' for x in r['start_us']):>30}  {w:>30}  {link:>7}  {r['blocks_sampled']:6d}  "
                  f"{what}")
            for e, m in enumerate(r.get("marks_us") or ()):      # the template's own marks (LUM_STAMP_AT)
                if m:
                    print(f"  {'mark ' + str(e + 2) + ': ' + '/'.join(f'{x:.2f}' for x in m):>30}")
        for kernel, rows in result.get("blocks", {}).items():         # the blocks that trail, over the steps
            print(f"  {kernel}: the {min(6, len(rows))} blocks furthest behind (median of {len(stamped)} steps; "
                  "µs after the module's first wait: waited / marks; behind the first to finish)")
            for r in sorted(rows, key=lambda r: -r["behind_us"])[:6]:
                marks = "/".join("-" if x is None else f"{x:.2f}" for x in r["marks_us"])
                print(f"    module {r['module']} block {r['block']:3d} SMs {sorted(set(r['sms']))}: waited "
                      f"{r['waited_us']:.2f}, marks {marks}, behind {r['behind_us']:.2f}, last in {r['last']}")
        log(f"wrote {out_path}")
        sess.close()
        pkg.close()
        return 0
    step_s = steps(args.steps)                        # unprofiled wall time per step
    p_mid = pos + args.steps // 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(args.steps)
    dyn = {"s": len(prompt), "p": 0} if args.entry == "prefill" else {"p": p_mid}
    ops = kernel_ops(pkg, args.entry, dyn)
    spans = _kernel_spans(prof)
    advance = critical_advance(spans)
    log(f"{len(spans)} kernel spans on the timeline")
    rows = []
    for evt in prof.key_averages():
        us = _device_us(evt)
        if us <= 0:
            continue
        info = ops.get(evt.key, {})
        per_step_us = us / args.steps
        launches = evt.count / args.steps
        nbytes = info.get("bytes", 0) * launches
        rows.append({"kernel": evt.key, "kind": info.get("kind", "library"), "op": info.get("op", ""),
                     "shape": info.get("shape"), "dtype": info.get("dtype"), "launches_per_step": launches,
                     "us_per_step": round(per_step_us, 2), "us_per_launch": round(per_step_us / max(launches, 1e-9), 2),
                     "advance_us_per_launch": round(advance.get(evt.key, 0.0) / args.steps / max(launches, 1e-9), 2),
                     "bytes_per_step": nbytes,
                     "GBps": round(nbytes / (per_step_us * 1e-6) / 1e9, 1) if nbytes and per_step_us else None})
    rows.sort(key=lambda r: -r["us_per_step"])
    kernel_us = sum(r["us_per_step"] for r in rows)
    launches = sum(r["launches_per_step"] for r in rows)
    by_kind: dict[str, dict] = defaultdict(lambda: {"us_per_step": 0.0, "launches_per_step": 0.0, "bytes_per_step": 0})
    for r in rows:
        k = by_kind[f"{r['kind']}/{r['op']}"]
        k["us_per_step"] += r["us_per_step"]
        k["launches_per_step"] += r["launches_per_step"]
        k["bytes_per_step"] += r["bytes_per_step"]
    weight_bytes = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in pkg.manifest.weights.values())
    result.update({
        "step_ms": round(step_s * 1e3, 3), "kernel_ms_per_step": round(kernel_us / 1e3, 3),
        "advance_ms_per_step": round(sum(advance.values()) / args.steps / 1e3, 3),
        "other_ms_per_step": round(step_s * 1e3 - kernel_us / 1e3, 3), "launches_per_step": launches,
        "p": p_mid if args.entry == "decode" else 0, "package_weight_bytes": weight_bytes,
        "by_kind": {k: {**v, "us_per_step": round(v["us_per_step"], 1)} for k, v in
                    sorted(by_kind.items(), key=lambda kv: -kv[1]["us_per_step"])},
        "idle_us_per_step": round((max(e for _, _, e in spans) - min(s for _, s, _ in spans)
                                   - sum(advance.values())) / args.steps, 2) if spans else None,
        "idle_gaps": [{**g, "us": round(g["us"] / args.steps, 2), "count": g["count"] / args.steps}
                      for g in idle_gaps(spans)],
        "rows": rows})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    log(f"step {step_s * 1e3:.3f} ms wall; kernels {kernel_us / 1e3:.3f} ms in {launches:.0f} launches; "
        f"other {step_s * 1e3 - kernel_us / 1e3:.3f} ms")
    for k, v in result["by_kind"].items():
        gbps = v["bytes_per_step"] / (v["us_per_step"] * 1e-6) / 1e9 if v["us_per_step"] else 0
        print(f"  {k:28s} {v['us_per_step']:9.1f} us  {v['launches_per_step']:7.1f} launches  {gbps:7.0f} GB/s")
    for r in rows[:args.top]:
        print(f"  {r['us_per_step']:8.1f} us {r['launches_per_step']:5.1f}x {r['us_per_launch']:7.2f} us/launch "
              f"(+{r['advance_us_per_launch']:6.2f} on the timeline) "
              f"{str(r['GBps']):>7} GB/s  {r['kind']}/{r['op']} {r['dtype']} {r['shape']}  {r['kernel'][:40]}")
    log(f"idle {result['idle_us_per_step']} µs a step, largest gaps (µs a step):")
    for g in result["idle_gaps"]:
        print(f"  {g['us']:7.2f} us {g['count']:5.1f}x  after {g['after'][:40]}  before {g['before'][:40]}")
    log(f"wrote {out_path}")
    sess.close()
    pkg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
