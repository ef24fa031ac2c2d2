"""cuBLASLt algorithms chosen at build time (issue 5): per gemm op, the heuristic's candidates timed on the GPU.

    version = tune_gemm_algos(programs, tables, typical_dyn(spec), options)

For every gemm op that stays a cuBLASLt call (no kernel in its group's launch table: lum's gemv kernel
runs gemms with a small static m) the parameters are evaluated at the typical dyn map; the
heuristic's candidates (:meth:`lum.loader.cublaslt.MatmulPlan.candidates`) are each run on seeded random
non-zero operands in device buffers of the problem's sizes (``WARMUP`` warm-ups, then the median of
``REPEATS`` CUDA-event timings of ``INNER`` back-to-back calls), and the fastest (ties: the heuristic's
order) goes into that group's launch table as ``gemms: [{"op", "algo": <128 hex>, "algo_dims": {m, n, k,
batch}}]``; the returned cuBLASLt version goes into ``target.cublaslt_version``. The loader passes a
stored algo only when its cuBLASLt version is the same (non-strict: cublasLtMatmulAlgoCheck falls back to
the heuristic when it does not fit the actual problem).

Only on a usable GPU of the target (:func:`lum.builder.tuning.gpu_unavailable_reason`); otherwise nothing
is stored and a CPU build is byte-identical to one without this step. Choices are cached in the tuning
DB (:class:`lum.builder.tuning.TuningDB`) keyed by the problem, GPU, driver and cuBLASLt version, so a
second build does not time again.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any, Callable, Mapping, Sequence

from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import GEMM_DEFAULTS, LOp, Program

__all__ = ["tune_gemm_algos", "choose_gemm_algos", "gemm_problem", "library_gemms", "WARMUP", "REPEATS", "INNER"]

WARMUP = 3
REPEATS = 7
INNER = 5
_NAMES = ("m", "n", "k", "lda", "ldb", "batch", "stride_a", "stride_b", "offset_a", "offset_b")

# time_fn(plan, problem) -> seconds for one call of ``plan``
TimeFn = Callable[[Any, dict], float]


def gemm_problem(op: LOp, dyn: Mapping[str, int], in_dtype: DType | None = None) -> dict | None:
    """The op's concrete parameters at ``dyn`` plus operand sizes in elements; None when the op is not a
    timeable matmul there (a var missing from ``dyn``, an empty output, k = 0). ``in_dtype``: the
    operands' dtype (default: the op's own; a 16-bit one under an f32 op is a mixed-precision gemm)."""
    try:
        v = {n: int(as_expr(op.params.get(n, GEMM_DEFAULTS.get(n))).evaluate(dyn)) for n in _NAMES}
    except Exception:  # noqa: BLE001 - a var the typical dyn map lacks: leave the op to the heuristic
        return None
    if v["batch"] * v["m"] * v["n"] == 0 or v["k"] == 0:
        return None
    layout = op.params["layout"]
    sizes = {}
    for name, rows, cols, ld, bstride, off, rm in (("a", v["m"], v["k"], v["lda"], v["stride_a"], v["offset_a"],
                                                    layout[:2] == "Rm"),
                                                   ("b", v["k"], v["n"], v["ldb"], v["stride_b"], v["offset_b"],
                                                    layout[2:] == "Rm")):
        s0, s1 = (ld, 1) if rm else (1, ld)
        nb = v["batch"] if bstride else 1
        sizes[name] = off + (nb - 1) * bstride + (rows - 1) * s0 + (cols - 1) * s1 + 1
    sizes["c"] = v["batch"] * v["m"] * v["n"]
    return {"layout": layout, "dtype": op.dtype, "in_dtype": in_dtype or op.dtype, **v,
            "size_a": sizes["a"], "size_b": sizes["b"], "size_c": sizes["c"]}


def _plan(lt: Any, p: dict, algo: bytes | None = None, strict: bool = False) -> Any:
    return lt.matmul_plan(p["layout"], p["m"], p["n"], p["k"], p["lda"], p["ldb"], p["n"], p["batch"], p["stride_a"],
                          p["stride_b"], p["m"] * p["n"], p["dtype"], algo, offset_a=p["offset_a"],
                          offset_b=p["offset_b"], strict_algo=strict, in_dtype=p["in_dtype"])


def _problem_key(p: dict) -> str:
    dts = DType(p["dtype"]).value
    if DType(p["in_dtype"]) != DType(p["dtype"]):
        dts = f"{DType(p['in_dtype']).value}>{dts}"
    return "gemm-algo:" + ",".join(f"{k}={p[k]}" for k in ("layout", *_NAMES)) + f",dtype={dts}"


def choose_gemm_algos(programs: Sequence[Program], tables: list[dict], dyn: Mapping[str, int], lt: Any,
                      time_fn: TimeFn, db: Any = None, db_fields: Mapping[str, str] | None = None) -> int:
    """Time every library gemm op's candidates with ``time_fn`` and add ``gemms`` entries to ``tables`` (in
    place, only for groups that have a table; a gemm with a kernel in the table is lum's own, not a
    cuBLASLt call). Returns how many ops got an algo. ``db``/``db_fields``
    (``gpu``, ``driver``): a :class:`~lum.builder.tuning.TuningDB` caching the choice per problem."""
    chosen: dict[str, bytes] = {}          # one timing per distinct problem in this build
    stored = 0
    for prog, table in zip(programs, tables):
        if not table:
            continue
        entries = []
        for op in library_gemms(prog, table):
            p = gemm_problem(op, dyn, prog.ops[op.args[0].src].dtype)
            if p is None:
                continue
            key = _problem_key(p)
            algo = chosen.get(key)
            if algo is None:
                algo = _choose_one(p, key, lt, time_fn, db, db_fields)
                if algo is None:
                    continue
                chosen[key] = algo
            entries.append({"op": op.id, "algo": algo.hex(),
                            "algo_dims": {"m": p["m"], "n": p["n"], "k": p["k"], "batch": p["batch"]}})
        if entries:
            table["gemms"] = entries
            stored += len(entries)
    return stored


def library_gemms(program: Program, table: Mapping[str, Any]) -> list[LOp]:
    """The program's gemm ops that stay cuBLASLt calls: those without a kernel in its launch table."""
    kernels = {o["op"] for o in table.get("ops", ())}
    return [op for op in program.ops if op.kind == "gemm" and op.id not in kernels]


def _choose_one(p: dict, key: str, lt: Any, time_fn: TimeFn, db: Any, db_fields: Mapping[str, str] | None
                ) -> bytes | None:
    from lum.builder.tuning import TuningDB

    dbkey = None
    if db is not None and db_fields:
        dbkey = TuningDB.key(key, db_fields["gpu"], db_fields["driver"], options={"cublaslt": lt.version()})
        rec = db.get(dbkey)
        if rec is not None and isinstance(rec.get("algo"), str):
            try:
                _plan(lt, p, bytes.fromhex(rec["algo"]), strict=True).close()
                return bytes.fromhex(rec["algo"])
            except Exception:  # noqa: BLE001 - stale record: time again
                pass
    try:
        base = _plan(lt, p)
    except Exception as exc:  # noqa: BLE001 - no plan: the loader's heuristic will say why at run time
        warnings.warn(f"lum: no cuBLASLt plan for gemm {key}: {' '.join(str(exc).split())[:200]}", stacklevel=3)
        return None
    best: tuple[float, int, bytes] | None = None
    trials = []
    for i, cand in enumerate(base.candidates()):
        try:
            plan = _plan(lt, p, cand.algo, strict=True)
        except Exception:  # noqa: BLE001 - a candidate the library then refuses
            continue
        try:
            t = float(time_fn(plan, p))
        finally:
            plan.close()
        trials.append({"candidate": i, "time": t})
        if best is None or t < best[0]:
            best = (t, i, cand.algo)
    base.close()
    if best is None:
        return None
    if dbkey is not None:
        db.put(dbkey, {"genome": [best[1]], "decisions": ["gemm candidate"], "trials": trials, "time": best[0],
                       "budget": len(trials), "algo": best[2].hex(), "problem": key})
    return best[2]


class CudaGemmTimer:
    """``time_fn`` on the GPU: per problem, device buffers of random non-zero values (cached by sizes),
    a workspace of the loader's default size; CUDA events around ``INNER`` calls, ``WARMUP`` warm-ups,
    median of ``REPEATS``."""

    def __init__(self) -> None:
        from lum.loader.cuda import driver as cu
        from lum.loader.cuda.runner import WORKSPACE_BYTES

        self.cu = cu
        self.ctx = cu.Context(0)
        self.stream = cu.Stream()
        self.ws = cu.DeviceBuffer(WORKSPACE_BYTES, "gemm timing workspace")
        drv = cu.drv
        self.events = [cu.call(drv.cuEventCreate, int(drv.CUevent_flags.CU_EVENT_DEFAULT)) for _ in range(2)]
        self.bufs: dict[tuple, list] = {}

    def _buffers(self, p: dict) -> list:
        from lum.builder.tuning import random_array

        dts = {"a": DType(p["in_dtype"]), "b": DType(p["in_dtype"]), "c": DType(p["dtype"])}
        key = (p["size_a"], p["size_b"], p["size_c"], dts["a"].value, dts["c"].value)
        if key not in self.bufs:
            out = []
            for name in ("a", "b", "c"):
                n, dt = p[f"size_{name}"], dts[name]
                buf = self.cu.DeviceBuffer(n * dt.itemsize, f"gemm timing {name}")
                host = random_array(f"gemm-{name}", (n,), dt)
                self.cu.call(self.cu.drv.cuMemcpyHtoD, buf.ptr, host.ctypes.data, host.nbytes)
                out.append(buf)
            self.bufs[key] = out
        return self.bufs[key]

    def __call__(self, plan: Any, p: dict) -> float:
        cu, drv = self.cu, self.cu.drv
        self.ctx.make_current()
        a, b, c = self._buffers(p)
        s, ws = self.stream, self.ws

        def calls(n: int) -> None:
            for _ in range(n):
                plan.run(s.ptr, a.ptr, b.ptr, c.ptr, ws.ptr, ws.nbytes)

        calls(WARMUP)
        times = []
        for _ in range(REPEATS):
            cu.call(drv.cuEventRecord, self.events[0], s.handle)
            calls(INNER)
            cu.call(drv.cuEventRecord, self.events[1], s.handle)
            cu.call(drv.cuEventSynchronize, self.events[1])
            times.append(float(cu.call(drv.cuEventElapsedTime, self.events[0], self.events[1])) * 1e-3 / INNER)
        return statistics.median(times)

    def close(self) -> None:
        self.stream.synchronize()
        for e in self.events:
            self.cu.call(self.cu.drv.cuEventDestroy, e)
        for bufs in self.bufs.values():
            for b in bufs:
                b.close()
        self.ws.close()
        self.stream.close()
        self.ctx.close()


def _open_gpu() -> tuple[Any, Any, dict]:
    """(cuBLASLt handle, time_fn, DB key fields) on this machine's GPU."""
    from lum.builder.tuning import device_identity
    from lum.loader.cublaslt import CublasLt

    ident = device_identity()
    timer = CudaGemmTimer()            # makes the primary context current before cuBLASLt's handle
    try:
        lt = CublasLt.load()
    except BaseException:
        timer.close()
        raise
    return lt, timer, {"gpu": ident.gpu, "driver": ident.driver}


def tune_gemm_algos(programs: Sequence[Program], tables: list[dict], dyn: Mapping[str, int], target: str,
                    db: Any = None) -> int | None:
    """Choose and store gemm algos (module docstring) when a GPU of ``target`` is usable; returns the
    cuBLASLt version to record in ``target.cublaslt_version``, or None when nothing was stored."""
    from lum.builder.tuning import TuningDB, gpu_unavailable_reason

    if not any(library_gemms(p, t) for p, t in zip(programs, tables) if t):
        return None
    if gpu_unavailable_reason(target) is not None:
        return None
    try:
        lt, timer, fields = _open_gpu()
    except Exception as exc:  # noqa: BLE001 - no cuBLASLt: the loader's heuristic chooses
        warnings.warn(f"lum: gemm algorithms not timed: {' '.join(str(exc).split())[:200]}", stacklevel=2)
        return None
    try:
        n = choose_gemm_algos(programs, tables, dyn, lt, timer, db if db is not None else TuningDB(), fields)
        return lt.version() if n else None
    finally:
        lt.close()
        close = getattr(timer, "close", None)
        if close is not None:
            close()
