"""Helpers shared by the benchmark scripts (decode.py, prefill.py): environment facts for the JSON record,
the random HF checkpoint every system reads, ``lum build``, and the worker subprocesses that keep a crash
or a timeout of one system from taking the whole run down.

Imported as ``_common`` (the scripts run as ``python benchmarks/<name>.py``, so this folder is on sys.path).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
_TAG = ["bench"]


def set_log_tag(tag: str) -> None:
    """The name each log line starts with (``decode-bench``, ``prefill-bench``)."""
    _TAG[0] = tag


def log(msg: str) -> None:
    sys.stderr.write(f"[{_TAG[0]} {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def _one_line(exc: BaseException | str, n: int = 400) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return " ".join(str(text).split())[:n]



# ====================================================================== timing on the device
class EventTimer:
    """Median seconds of work enqueued on a CUDA stream, between two events (lum's driver module ``cu``);
    one untimed call first. For the kernel benchmarks that drive the device themselves."""

    def __init__(self, cu, stream):
        self.cu, self.stream = cu, stream
        flags = int(cu.drv.CUevent_flags.CU_EVENT_DEFAULT)
        self.events = [cu.call(cu.drv.cuEventCreate, flags) for _ in range(2)]

    def __call__(self, fn: Callable[[], None], reps: int) -> float:
        cu, drv, (start, end) = self.cu, self.cu.drv, self.events
        fn()
        self.stream.synchronize()
        times = []
        for _ in range(reps):
            cu.call(drv.cuEventRecord, start, self.stream.handle)
            fn()
            cu.call(drv.cuEventRecord, end, self.stream.handle)
            cu.call(drv.cuEventSynchronize, end)
            times.append(float(cu.call(drv.cuEventElapsedTime, start, end)) * 1e-3)
        return sorted(times)[len(times) // 2]

    def close(self) -> None:
        for e in self.events:
            self.cu.call(self.cu.drv.cuEventDestroy, e)
        self.events = []


class ProbeDevice:
    """What a GPU probe (pdl_probe.py, phase_probe.py) holds: a context and a stream, its kernels
    (templates/common.cuh, benchmarks/probe.cuh, then ``benchmarks/<cu_file>``, compiled by NVRTC for
    this GPU), an :class:`EventTimer`, the buffers it allocated and the parameter arrays it packed (kept
    alive while a graph refers to them)."""

    def __init__(self, cu_file: str):
        import numpy as np
        from lum.builder import nvrtc
        from lum.loader.cuda import driver as cu
        from lum.loader.cuda.plan import ParamPack

        self.np, self.cu, self.drv, self._pack = np, cu, cu.drv, ParamPack
        self.info = cu.device_info(0)
        self.ctx = cu.Context(0)
        self.stream = cu.Stream()
        source = "".join(p.read_text() for p in (HERE.parent / "templates" / "common.cuh", HERE / "probe.cuh",
                                                 HERE / cu_file))
        self.module = cu.Module(nvrtc.compile_cuda(source, self.info.sm, name=cu_file).cubin, cu_file)
        self.timed = EventTimer(cu, self.stream)
        self._buffers: list = []
        self._packs: list = []

    def buffer(self, nbytes: int):
        b = self.cu.DeviceBuffer(nbytes, "probe")
        self._buffers.append(b)
        return b

    def upload(self, arr):
        b = self.buffer(arr.nbytes)
        self.cu.call(self.drv.cuMemcpyHtoD, b.ptr, arr.ctypes.data, arr.nbytes)
        return b

    def write(self, buf, arr) -> None:
        self.cu.call(self.drv.cuMemcpyHtoD, buf.ptr, arr.ctypes.data, arr.nbytes)

    def read(self, buf, count: int, dtype: str = "float32"):
        out = self.np.empty(count, dtype)
        self.cu.call(self.drv.cuMemcpyDtoH, out.ctypes.data, buf.ptr, out.nbytes)
        return out

    def chain(self, record, poison, outs, count: int, want, reps: int, check=None) -> tuple[float, float, bool]:
        """One probe mode: ``poison`` ((buffers, bytes) pairs) filled with NaN, ``record`` (a stream's launches)
        captured as a CUDA graph and run once, its ``outs`` (``count`` floats each) against ``want`` (float64),
        then timed. (median seconds a replay, the largest error relative to each output's largest value, all
        finite). ``check``: instead of ``want``, a function of the outputs (float64) giving (error, all finite)."""
        np, cu, stream = self.np, self.cu, self.stream
        for bufs, nbytes in poison:
            for b in bufs:
                cu.memset(b.ptr, 0xFF, nbytes, stream)          # NaN: an unwritten output cannot pass
        graph = cu.Graph(stream, record)
        try:
            graph.launch(stream)
            stream.synchronize()
            got = [self.read(b, count).astype(np.float64) for b in outs]
            if check is not None:
                err, finite = check(got)
            else:
                err = max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want))
                finite = all(np.isfinite(g).all() for g in got)
            return self.timed(lambda: graph.launch(stream), reps), err, finite
        finally:
            graph.close()

    def pack(self, values) -> int:
        """The ``void**`` address of a launch's parameters: pointers and non-negative ints, 8 bytes each
        (a kernel's int parameter reads the low 4)."""
        p = self._pack(values)
        self._packs.append(p)
        return p.address

    def close(self) -> None:
        self.stream.synchronize()
        self.timed.close()
        for b in reversed(self._buffers):
            b.close()
        self._buffers = []
        self.module.close()
        self.stream.close()
        self.ctx.close()


# ====================================================================== environment
def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=HERE).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True,
                               cwd=HERE).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - best effort
        return "unknown"


def prompt_ids(vocab: int, bos: int | None, n: int) -> list[int]:
    ids = [(1000 + 37 * i) % vocab for i in range(n)]
    if bos is not None and n:
        ids[0] = int(bos)
    return ids


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_and_target(torch, device: str) -> tuple[str, str]:
    """The GPU's name and the sm target to build for (``sm_90`` in the CPU smoke-test mode)."""
    if device != "cuda":
        return "cpu (smoke test)", "sm_90"
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch")
    cap = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"sm_{cap[0]}{cap[1]}"


def _lum_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lum")
    except Exception:  # noqa: BLE001
        return None



# ====================================================================== HF model and lum package
def hf_classes(model_type: str):
    import transformers as T

    return {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
            "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}[model_type]


def make_hf_folder(name: str, dtype: str, folder: Path, seed: int, device: str = "cuda") -> dict:
    """A random HF model of our named config, initialised on the GPU, saved to ``folder``."""
    import torch

    cfg = _named_config(name).to_hf_dict()
    config_cls, model_cls = hf_classes(cfg["model_type"])
    hf_config = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    tdt = getattr(torch, TORCH_DTYPES[dtype])
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    def construct():
        try:
            return model_cls._from_config(hf_config, dtype=tdt)
        except TypeError:
            return model_cls._from_config(hf_config, torch_dtype=tdt)

    try:
        with torch.device(device):        # initialised on the GPU: seconds, not minutes
            model = construct()
    except (ValueError, ImportError) as exc:
        if "accelerate" not in str(exc):
            raise
        log(f"initialising on the CPU ({_one_line(exc, 120)})")
        model = construct()
    model = model.to(device=device, dtype=tdt).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    _sync(torch, device)
    t1 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    t2 = time.perf_counter()
    info = {"hf_init_s": round(t1 - t0, 2), "hf_save_s": round(t2 - t1, 2), "weight_bytes": weight_bytes_of(model)}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return info


def _named_config(name: str):
    """lum's named config; straight from builder/models/config.py (numpy only) if lum is not installed."""
    try:
        from lum.builder.models import named_config
    except ImportError:
        import importlib.util

        path = HERE.parent / "builder" / "models" / "config.py"
        mod_spec = importlib.util.spec_from_file_location("_lum_model_config", path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = mod          # dataclasses look their module up
        mod_spec.loader.exec_module(mod)
        named_config = mod.named_config
    return named_config(name)


def weight_bytes_of(model) -> int:
    """Bytes of distinct parameter storages (a tied embedding / lm head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return int(total)


def build_package(hf_dir: Path, pkg: Path, dtype: str, max_seq: int, target: str, timeout: float, log_path: Path,
                  env: dict[str, str] | None = None, budget: int = 0, tune: str | None = None):
    """``lum build`` in a subprocess (``env``: extra environment variables for it; ``budget``: measured-search
    evaluations per group, 0 for the cost model; ``tune``: the entries it measures, e.g. ``decode``);
    (seconds, error)."""
    cmd = [sys.executable, "-c", "import sys; from lum.loader.cli import main; main(sys.argv[1:])", "build",
           str(hf_dir), "-o", str(pkg), "--dtype", dtype, "--max-seq", str(max_seq), "--target", target]
    if budget:
        cmd += ["--budget", str(budget)] + (["--tune", tune] if tune else [])
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            res = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout,
                                 env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            logf.flush()
            lines = log_path.read_text(errors="replace").strip().splitlines()   # its last progress line
            return None, f"lum build timed out after {timeout:.0f} s" + (f" at: {lines[-1].strip()}" if lines else "")
    dt = time.perf_counter() - t0
    if res.returncode != 0 or not pkg.exists():
        tail = log_path.read_text(errors="replace")[-600:]
        return None, f"lum build failed (exit {res.returncode}): {_one_line(tail)}"
    return dt, None



# ====================================================================== workers (subprocesses)
def _sync_all() -> None:
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            return
    except ImportError:
        pass
    try:
        from cuda.bindings import driver as cu

        cu.cuCtxSynchronize()
    except Exception:  # noqa: BLE001 - nothing to synchronise
        pass



def _hf_load(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    tdt = getattr(torch, TORCH_DTYPES[spec["dtype"]])
    dev = spec.get("device", "cuda")

    def load(**kw):
        try:
            return AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=tdt, attn_implementation="sdpa", **kw)
        except TypeError:
            return AutoModelForCausalLM.from_pretrained(spec["hf_dir"], torch_dtype=tdt, attn_implementation="sdpa",
                                                        **kw)

    try:
        model = load(device_map=dev)          # straight to the GPU (needs accelerate)
    except (ValueError, ImportError) as exc:
        if "accelerate" not in str(exc):
            raise
        model = load().to(dev)
    return model.eval()



def _graph_count(torch) -> int:
    """Graphs torch.compile has made in this process so far (-1 where the counter is not there)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1


def run_worker_main(workers: dict[str, Callable[[dict], dict]], system: str, spec_path: str, result_path: str) -> int:
    """The worker side: run ``workers[system](spec)`` and write its result (or its error) as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    spec["_result"], spec["_t0"] = result_path, time.perf_counter()
    try:
        res = workers[system](spec)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's error
        res = {"error": _one_line(exc), "traceback": traceback.format_exc()[-3000:]}
        code = 1
    Path(result_path).write_text(json.dumps(res))
    return code


def run_worker(script: Path, system: str, spec: dict, workdir: Path, timeout: float) -> dict:
    """Run ``script --_worker system`` in its own process; a crash, a missing result or a timeout becomes
    ``error`` (a partial result written before a timeout is kept)."""
    spec_path = workdir / f"spec-{system}.json"
    res_path = workdir / f"result-{system}.json"
    log_path = workdir / f"log-{system}.txt"
    spec_path.write_text(json.dumps({**spec, "budget_s": timeout}))
    if res_path.exists():
        res_path.unlink()
    cmd = [sys.executable, str(Path(script).resolve()), "--_worker", system, "--_spec", str(spec_path),
           "--_result", str(res_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            if res_path.exists():      # a partial result written before the stop
                res = json.loads(res_path.read_text())
                res["wall_s"] = round(time.perf_counter() - t0, 1)
                return res
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": round(time.perf_counter() - t0, 1)}
    wall = round(time.perf_counter() - t0, 1)
    if res_path.exists():
        res = json.loads(res_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-600:]
        res = {"error": f"worker exited {rc} without a result: {_one_line(tail)}"}
    res["wall_s"] = wall
    if "traceback" in res:
        log(f"{system} failed:\n{res['traceback']}")
    return res



def add_run_args(ap: argparse.ArgumentParser, time_limit: float, pkg_help: str) -> None:
    """The options decode.py and prefill.py share: where things go, what to reuse, what to record."""
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="folder for the JSON result")
    ap.add_argument("--workdir", default=None, help="where the HF folder and the package go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--hf-dir", default=None, help="reuse this HF folder instead of making one")
    ap.add_argument("--pkg", default=None, help=pkg_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD here)")
    ap.add_argument("--time-limit", type=float, default=time_limit, help="seconds for the whole run")
    ap.add_argument("--lum-backend", default="cuda", help=argparse.SUPPRESS)   # reference: smoke tests only
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke test of the script on tiny models (lum's cuda row then records its error)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)


def run_and_record(result: dict, rows: dict[str, dict], out_path: Path, workdir: Path, keep: bool, t_start: float,
                   device: str, run: Callable, measured: str, print_table: Callable[[dict], None]) -> int:
    """Run ``run(torch)`` and write the JSON record whatever happens: an environment without torch, or an
    exception part-way, turns into ``error`` fields of the rows that have no ``measured`` figure yet."""

    def finish(code: int) -> int:
        result["rows"] = list(rows.values())
        result["timings_s"]["total"] = round(time.perf_counter() - t_start, 1)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        path = unused_path(out_path)
        path.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {path}")
        print_table(result)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return code

    try:
        import torch
        import transformers

        result["versions"].update(torch=torch.__version__, transformers=transformers.__version__)
        result["gpu"], result["target"] = gpu_and_target(torch, device)
    except Exception as exc:  # noqa: BLE001
        for r in rows.values():
            r["error"] = f"environment: {_one_line(exc)}"
        return finish(1)
    result["versions"]["lum"] = _lum_version()
    try:
        run(torch)
    except Exception as exc:  # noqa: BLE001 - the JSON is written whatever happens
        log(traceback.format_exc())
        result["error"] = _one_line(exc)
        for r in rows.values():
            if r[measured] is None and not r["error"]:
                r["error"] = f"benchmark stopped: {_one_line(exc)}"
        return finish(1)
    return finish(0)


def run_systems(rows: dict[str, dict], cap_s: dict[str, float], deadline: float, time_limit: float,
                run_one: Callable[[str, float], dict]) -> dict[str, dict]:
    """Run each system whose row has no error yet, each in its own process (``run_one(system, timeout)``)
    within its cap and what is left of the time limit. Errors and skips land in the rows; returns the
    results of the systems that ran."""
    done: dict[str, dict] = {}
    for s, row in rows.items():
        if row["error"]:
            continue
        left = deadline - time.perf_counter() - 10
        if left < 30:
            row["error"] = f"skipped: {left + 10:.0f} s left of the {time_limit:.0f} s time limit"
            continue
        log(f"{s}: running (up to {min(cap_s[s], left):.0f} s)")
        res = run_one(s, min(cap_s[s], left))
        row["wall_s"] = res.get("wall_s")
        if res.get("error"):
            row["error"] = res["error"]
            log(f"{s}: {res['error']}")
            continue
        done[s] = res
    return done


def record_head(benchmark: str, commit: str | None, gpu: str | None) -> dict:
    """A JSON record's first fields: what ran, on which commit (``git rev-parse`` here when not given), GPU
    and driver, and when."""
    return {"benchmark": benchmark, "commit": commit or _commit(), "gpu": gpu, "driver": _driver(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def add_record_args(ap: argparse.ArgumentParser) -> None:
    """``--out`` and ``--commit``, as the kernel benchmarks (gemv_sweep.py and the probes) take them."""
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="folder for the JSON record")
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD here)")


def unused_path(path: Path) -> Path:
    """``path``, or ``<stem>-2.json``, ``-3`` … when a record already has that name: records are named by day,
    and a second run of the same benchmark that day must not overwrite the first's."""
    free, k = path, 2
    while free.exists():
        free, k = path.with_name(f"{path.stem}-{k}{path.suffix}"), k + 1
    return free


def write_record(record: dict, out: str | Path, stem: str) -> Path:
    """``record`` as ``<out>/<stem>-<today>.json`` (``-2`` … if taken; the folder made when missing); returns the
    path."""
    path = unused_path(Path(out) / f"{stem}-{_dt.date.today().isoformat()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def new_record(benchmark: str, args: argparse.Namespace, config: dict, **extra) -> tuple[dict, Path, Path]:
    """The JSON record's head (commit, GPU, driver, date, config …), the file it goes to
    (``<out>/<benchmark>-<model>-<dtype>-<date>.json``; written with ``-2`` … if taken: :func:`unused_path`) and
    the work folder (``--workdir`` or a temp dir)."""
    result: dict = {**record_head(benchmark, args.commit, None), **extra, "config": config,
                    "versions": {"python": sys.version.split()[0]}, "timings_s": {}, "rows": []}
    out_path = Path(args.out) / f"{benchmark}-{args.model}-{args.dtype}-{_dt.date.today().isoformat()}.json"
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"lum-{benchmark}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return result, out_path, workdir
