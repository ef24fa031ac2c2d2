"""Flash attention for prefill (templates/flash_attention.cu) on a GPU, at the shapes of gemma3-4b (4 kv heads
of 2 query heads, head_dim 256, a causal mask and a sliding window of 1,024) and llama3-1b (8 of 4, 128),
2,048-token prompts (marker ``gpu``; each test is skipped where no CUDA device is usable):

    python -m pytest -m gpu tests/test_gpu_flash.py -v -rs

(a) the kernel launched alone, its partials poisoned (NaN) before, combined here and checked against softmax
attention computed in float64 (normwise relative error; NaN never passes), then timed with CUDA events
(the record's ``ms``, ``tflops`` over the pairs the mask shows, and torch SDPA's time on the same causal
problem where torch has CUDA: for reading, not asserted); (b) the whole LLIR (partials and the combine) in
a package, through the CUDA backend (the loader opts the kernel in to its shared memory), the arena
poisoned, a prompt after a past and one of more than 4,096 keys (two chunks).
"""

from __future__ import annotations

import numpy as np
import pytest

import lum.loader
from lum.format.dtypes import DType
from tests.flash_cases import FlashCase, flash_inputs, flash_program, flash_reference
from tests.kernel_cases import compare, entry_for

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_device")]

GEMMA = FlashCase("gemma", 4, 2, 256, 256)
LLAMA = FlashCase("llama", 8, 4, 128, 128)
# name: (case, dtype, s, p)
SHAPES = {
    "gemma3-4b-causal": (GEMMA, DType.bf16, 2048, 0),
    "gemma3-4b-sliding1024": (FlashCase("gemma", 4, 2, 256, 256, "sliding", window=1024), DType.bf16, 2048, 0),
    "llama3-1b-causal": (LLAMA, DType.bf16, 2048, 0),
    "llama3-1b-causal-f32": (LLAMA, DType.f32, 2048, 0),
    "gemma3-4b-causal-f32": (GEMMA, DType.f32, 1024, 0),
}
TOL = {DType.bf16: 1e-2, DType.f32: 1e-4}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.serial
def test_flash_kernel_at_model_shapes_matches_float64(shape, cuda_device, record_property):
    from lum.builder import nvrtc
    from lum.builder.codegen import generate
    from lum.loader.cuda import driver as cu
    from lum.loader.cuda.plan import ParamPack

    case, dt, s, p = SHAPES[shape]
    t = p + s
    prog = flash_program([case], dt, t)
    op = next(o for o in prog.ops if o.kind == "attention")
    ks = generate(op, ["p", "s"], arg_dtypes=[prog.ops[a.src].dtype for a in op.args], max_dyn={"p": 8192, "s": 8192})
    dyn = {"p": p, "s": s}
    ins = flash_inputs([case], dt, t, s, p, seed=7)
    ctx = cu.Context(0)
    stream = cu.Stream()
    owned = []
    try:
        mod = cu.Module(nvrtc.compile_cuda(ks.source, cuda_device.sm).cubin, "flash attention test")
        owned.append(mod)
        fn = mod.function(ks.name, ks.shared_mem)

        def upload(a: np.ndarray) -> int:
            a = np.ascontiguousarray(a)
            b = cu.DeviceBuffer(max(a.nbytes, 16), "flash test")
            owned.append(b)
            cu.memcpy_htod(b.ptr, a.ctypes.data, a.nbytes, stream)
            stream.synchronize()
            return b.ptr

        args = [upload(ins[f"{case.name}.{x}"].view(np.uint8)) for x in ("q", "k", "v", "mask")]
        shape_out = tuple(x.evaluate(dyn) for x in op.shape)
        nbytes = int(np.prod(shape_out)) * 4
        out = cu.DeviceBuffer(nbytes, "flash partials")
        owned.append(out)
        cu.memset(out.ptr, 0xFF, nbytes, stream)                       # NaN: an unwritten partial cannot pass
        dbuf = upload(np.asarray([dyn[v] for v in ks.dyn_vars], np.int64))
        pack = ParamPack([out.ptr, *args, dbuf])
        grid = tuple(g.evaluate(dyn) for g in ks.grid)

        def launch() -> None:
            cu.launch_kernel(fn, grid, ks.block, ks.shared_mem, stream, pack.address)

        launch()
        stream.synchronize()
        part = np.empty(shape_out, np.float32)
        cu.memcpy_dtoh(part.ctypes.data, out.ptr, nbytes, stream)
        stream.synchronize()
        dv = case.dv
        c, l, acc = part[..., dv].astype(np.float64), part[..., dv + 1].astype(np.float64), part[..., :dv]
        w = np.exp2(c - c.max(-1, keepdims=True))                      # the combine of the chunks
        got = (w[..., None] * acc).sum(-2) / (w * l).sum(-1)[..., None]
        err = compare(got, flash_reference(case, ins, dt), TOL[dt])
        assert err is None, f"{shape}: {err}"
        # time it
        ev = [cu.Event(timing=True), cu.Event(timing=True)]
        owned += ev
        for _ in range(3):
            launch()
        reps = 20
        ev[0].record(stream)
        for _ in range(reps):
            launch()
        ev[1].record(stream)
        ev[1].synchronize()
        ms = ev[1].elapsed_ms(ev[0]) / reps
        pairs = int(ins[f"{case.name}.mask"].sum()) * case.nkv * case.group
        tflops = 2 * pairs * (case.d + case.dv) / (ms * 1e-3) / 1e12
        record_property("ms", round(ms, 4))
        record_property("tflops", round(tflops, 1))
        record_property("tuning", dict(ks.tuning))
        sdpa = _sdpa_ms(case, ins, dt) if case.mask == "causal" and p == 0 else None
        if sdpa is not None:
            record_property("sdpa_ms", round(sdpa, 4))
        print(f"\n{shape}: {ms:.3f} ms, {tflops:.0f} TFLOP/s over the visible pairs, torch SDPA {sdpa} ms, "
              f"tuning {ks.tuning}")
    finally:
        stream.synchronize()
        for o in reversed(owned):
            o.close()
        stream.close()
        ctx.close()


def _sdpa_ms(case: FlashCase, ins: dict[str, np.ndarray], dt: DType) -> float | None:
    """torch's scaled_dot_product_attention on the same causal problem (for the record), or None without torch
    on CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tdt = torch.bfloat16 if dt == DType.bf16 else torch.float32
    s, t = ins[f"{case.name}.mask"].shape

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).astype(np.float32)).to("cuda", tdt)

    q = tensor(ins[f"{case.name}.q"]).unsqueeze(0)                                 # [1, nh, s, d]
    k = tensor(ins[f"{case.name}.k"][:t, :, :case.d]).permute(1, 0, 2).repeat_interleave(case.group, 0).unsqueeze(0)
    v = tensor(ins[f"{case.name}.v"][:t, :, :case.dv]).permute(1, 0, 2).repeat_interleave(case.group, 0).unsqueeze(0)
    k, v = k.contiguous(), v.contiguous()
    f = torch.nn.functional.scaled_dot_product_attention
    for _ in range(3):
        f(q, k, v, is_causal=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        f(q, k, v, is_causal=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


@pytest.mark.parametrize("shape", ["gemma3-4b-past", "llama3-1b-two-chunks", "gemma3-4b-sliding-past-f32"])
def test_flash_attention_program_through_the_cuda_backend(shape, tmp_path):
    """The partials and their combine (builder/extract.attention_ops) as a package run by the CUDA backend:
    512 rows after a past of 1,536 (gemma3-4b), 4,096 rows after 2,048 (llama3-1b: 6,144 keys, two chunks of
    4,096), f32 with a sliding window; the arena poisoned; against float64."""
    from lum.builder.package_builder import BuildOptions, write_program_package
    from lum.loader.errors import BackendUnavailableError

    case, dt, s, p = {"gemma3-4b-past": (GEMMA, DType.bf16, 512, 1536),
                      "llama3-1b-two-chunks": (LLAMA, DType.bf16, 4096, 2048),
                      "gemma3-4b-sliding-past-f32": (FlashCase("gemma", 4, 2, 256, 256, "sliding", window=1024),
                                                     DType.f32, 700, 900)}[shape]
    t = p + s
    prog = flash_program([case], dt, t)
    path = write_program_package(tmp_path / f"{shape}.lumpkg", [prog], {"main": entry_for(prog, None, ("p", "s"))},
                                 model={"max_seq": 8192}, options=BuildOptions())
    pkg = lum.loader.open(path)
    ins = flash_inputs([case], dt, t, s, p, seed=11)
    try:
        sess = pkg.session(dyn={"s": s, "p": p}, backend="cuda")
    except BackendUnavailableError as exc:
        pytest.skip(f"CUDA backend unavailable: {exc}")
    with sess:
        sess.runner.fill_arena(0xFF)
        got = sess.run("main", ins, {"s": s, "p": p})[f"{case.name}.y"]
    err = compare(got, flash_reference(case, ins, dt), TOL[dt])
    assert err is None, f"{shape}: {err}"
