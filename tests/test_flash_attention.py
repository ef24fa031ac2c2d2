"""Flash attention for prefill (templates/flash_attention.cu), derived from the same HLIR pattern and LLIR op as
decode's split-K kernel: the rule fires on prefill's softmax(where(mask, q·k·scale, -inf))·v, whose query rows
sharing a K / V row are the GQA group times the prompt, and on no near miss; codegen makes a tensor-core kernel
of it for 16-bit models and an FMA one for f32, which NVRTC compiles for sm_90 (and sm_80, sm_75) without
spills at gemma3-4b's and llama3-1b's head sizes; and on the host emulation (tests/cuda_emulation.py) the
kernel computes what the reference backend computes, poisoned outputs, for every mask, GQA group, prompt
length, past and tile shape here, never reading a key tile that the mask hides from all of a block's rows,
and the tiny models generate the reference's tokens with their prefill running it. GPU runs at real shapes:
tests/test_gpu_flash.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog")

import lum.loader  # noqa: E402
from lum.builder import frontend as F  # noqa: E402
from lum.builder.attention_policy import flash_attention  # noqa: E402
from lum.builder.codegen import CodegenError, generate  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.egraph import saturate  # noqa: E402
from lum.builder.extract import FLASH_ATTENTION_CHUNK  # noqa: E402
from lum.builder.hlir import Graph  # noqa: E402
from lum.builder.reference import run_graph  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import Var  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402
from tests.flash_cases import FlashCase, flash_program  # noqa: E402
from tests.kernel_cases import entry_for  # noqa: E402
from tests.test_attention import attention_options, attention_rule_program  # noqa: E402

RNG = np.random.default_rng(17)


# ====================================================================== the rule, in prefill
def _prefill_graph(variant: str = "prefill", dtype: str = "bf16", d: int = 16) -> tuple[Graph, dict]:
    """Prefill attention as the decoders write it: GQA 2 kv heads x 3, s new rows after a past of p, a [32, 2, d]
    cache read [0, p + s), a [s, p + s] mask; and near misses of it."""
    g = Graph(variant)
    s, p = Var("s"), Var("p")
    t = p + s
    q = F.input_tensor(g, "q", [2, 3, s, d], dtype)
    kc = F.input_tensor(g, "k", [32, 2, d], dtype)
    vc = F.input_tensor(g, "v", [32, 2, d], dtype)
    mask = F.input_tensor(g, "mask", [s, t], "bool")

    def heads(c):
        return c.slice(0, 0, t).permute(1, 0, 2).expand_dim(1, 3)

    f32 = DType.f32
    scores = F.matmul(q.cast(f32), heads(kc.cast(f32)).transpose(-2, -1)) * d ** -0.5
    if variant == "scale-after-mask":
        logits = F.where(mask, F.matmul(q.cast(f32), heads(kc.cast(f32)).transpose(-2, -1)), float("-inf")) * 0.25
    elif variant == "no-mask":
        logits = scores
    else:
        logits = F.where(mask, scores, float("-inf"))
    probs = logits.softmax(2) if variant == "softmax-over-rows" else logits.softmax(-1)
    F.output(F.matmul(probs.cast(dtype), heads(vc)), "out")
    return g, {"s": 9, "p": 4}


def _inputs(g: Graph, dyn: dict) -> dict:
    out = {}
    for n in g.inputs():
        shape = tuple(x.evaluate(dyn) for x in n.shape)
        if n.dtype == DType.bool:
            pos = dyn["p"] + np.arange(shape[0])[:, None]
            out[n.attrs["name"]] = np.arange(shape[1])[None, :] <= pos      # causal
        else:
            out[n.attrs["name"]] = RNG.normal(size=shape).astype(n.dtype.np)
    return out


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_rule_fires_on_prefill_attention_and_lowers_it_to_flash_attention(dtype):
    g, dyn = _prefill_graph("prefill", dtype)
    views, prog = attention_rule_program(g, dtype)
    assert all(v.flash and v.group == (1, 2) for v in views)
    att = next(o for o in prog.kernels() if o.kind == "attention")
    assert flash_attention(att) and att.params["chunk"] == FLASH_ATTENTION_CHUNK
    for s, p in ((9, 4), (1, 0), (20, 0)):
        dyn = {"s": s, "p": p}
        inputs = _inputs(g, dyn)
        want = run_graph(g, inputs, dyn)["out"].astype(np.float64)
        got = execute(prog, inputs, dyn)["out"].astype(np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < (1e-5 if dtype == "f32" else 2e-2), (s, p)


@pytest.mark.parametrize("variant", ["no-mask", "scale-after-mask", "softmax-over-rows"])
def test_the_rule_does_not_fire_on_prefill_near_misses(variant):
    g, dyn = _prefill_graph(variant, "f32")
    sat = saturate(g)
    assert not attention_options(sat)


def test_features_flash_attention_does_not_take_stay_unfused():
    """d = 24 is no multiple of 16: no attention node becomes an option, the GEMMs compute it."""
    g, dyn = _prefill_graph("prefill", "bf16", d=24)
    sat = saturate(g)
    assert sat.fired("attention-rounded") == 1
    assert not attention_options(sat)
    prog, _ = compile_group(g, sat=sat)
    assert "attention" not in [o.kind for o in prog.kernels()]
    inputs = _inputs(g, dyn)
    want = run_graph(g, inputs, dyn)["out"].astype(np.float64)
    assert np.abs(execute(prog, inputs, dyn)["out"] - want).max() / np.abs(want).max() < 2e-2


@pytest.mark.parametrize("model,dtype", [("gemma3-4b", "bf16"), ("llama3-1b", "bf16"), ("llama3-1b", "f32")])
def test_the_cost_model_picks_flash_attention_for_long_prompts(model, dtype):
    """A prefill layer extracted by the cost model at a 4,096-token prompt: one attention op, no GEMM for q·k
    or p·v (the unfused GEMMs on tensor cores would win if the flash kernel were costed on CUDA cores)."""
    from lum.builder import costmodel
    from lum.builder.extract import choose_by_cost, lower
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    from lum.builder.partition import chunk_graph, group_chunks, partition

    cfg = named_config(model)
    g = build_entry(cfg, "prefill", 4096, DType.parse(dtype))
    layer = [grp for grp in group_chunks(g, partition(g)) if len(grp) == cfg.num_layers][0]
    sat = saturate(chunk_graph(g, layer.representative))
    prog = lower(sat, choose_by_cost(sat, lambda o: costmodel.op_cost(o, {"s": 4096})))
    att = [o for o in prog.ops if o.kind == "attention"]
    assert len(att) == 1 and flash_attention(att[0])
    assert sum(o.kind == "gemm" for o in prog.ops) == 4                 # qkv, o, gate-up, down
    peak = costmodel._peak(att[0], costmodel.H200, prog)
    assert peak == (costmodel.H200.tensor_flops if dtype == "bf16" else costmodel.H200.fp32_flops)


def test_flash_attention_switched_off_keeps_prefill_on_gemms(monkeypatch):
    """``$LUM_FLASH_ATTENTION=0``: prefill's q·k and p·v stay GEMMs (six in a layer), no attention op; decode's
    split-K attention is not flash attention and stays."""
    from lum.builder import costmodel
    from lum.builder.extract import choose_by_cost, lower
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    from lum.builder.partition import chunk_graph
    from tests.model_layers import layer_groups

    monkeypatch.setenv("LUM_FLASH_ATTENTION", "0")
    cfg = named_config("llama3-1b")
    kinds = {}
    for entry in ("prefill", "decode"):
        g = build_entry(cfg, entry, 4096, DType.bf16)
        layer = layer_groups(g)[0]
        sat = saturate(chunk_graph(g, layer.representative))
        prog = lower(sat, choose_by_cost(sat, lambda o: costmodel.op_cost(o, {"s": 4096, "p": 4096})))
        kinds[entry] = [o.kind for o in prog.ops]
    assert "attention" not in kinds["prefill"] and kinds["prefill"].count("gemm") == 6
    assert kinds["decode"].count("attention") == 1


# ====================================================================== codegen and NVRTC
def _op(case: FlashCase, dt: DType):
    prog = flash_program([case], dt, 64)
    return next(o for o in prog.ops if o.kind == "attention"), [prog.ops[a.src].dtype for a in prog.ops[4].args]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_75"])
@pytest.mark.parametrize("dt", [DType.bf16, DType.f16, DType.f32], ids=str)
def test_flash_template_compiles(nvrtc, tmp_path, arch, dt):
    """Tensor-core instructions in 16-bit kernels from sm_80 on, none before (the mma's fallback) or for f32."""
    ks = []
    for d, dv, kw in ((64, 64, {}), (256, 256, {}), (32, 48, {"tile_keys": 16, "threads": 64}),
                      (128, 128, {"tile_keys": 128})):
        op, dts = _op(FlashCase("c", 2, 2, d, dv), dt)
        ks.append(generate(op, ["p", "s"], arg_dtypes=dts, max_dyn={"p": 64, "s": 64}, **kw))
    from lum.builder.codegen import module_source

    res = nvrtc.compile_cuda(module_source(ks), arch, cache_dir=tmp_path)
    assert res.cubin[:4] == b"\x7fELF" and f".target {arch}" in res.ptx
    tc = dt != DType.f32 and arch != "sm_75"
    assert ("mma.sync.aligned.m16n8k16" in res.ptx) == tc and ("ldmatrix" in res.ptx) == tc
    assert ("cp.async.cg.shared.global" in res.ptx) == (arch != "sm_75")
    assert all(k.tuning["flash"] == ("fma" if dt == DType.f32 else "mma") for k in ks)


@pytest.mark.parametrize("dt,d,nkv,group", [(DType.bf16, 256, 4, 2), (DType.bf16, 128, 8, 4), (DType.f32, 256, 4, 2),
                                            (DType.f32, 128, 8, 4)], ids=["gemma3-4b", "llama3-1b", "gemma3-4b-f32",
                                                                          "llama3-1b-f32"])
def test_flash_kernels_of_real_head_sizes_do_not_spill(nvrtc, tmp_path, dt, d, nkv, group, record_property):
    """ptxas -v for sm_90: no spill, and the dynamic shared memory above 48 KB that the launch asks for (the
    loader opts the function in to it)."""
    op, dts = _op(FlashCase("c", nkv, group, d, d), dt)
    k = generate(op, ["p", "s"], arg_dtypes=dts, max_dyn={"p": 8192, "s": 8192})
    log = nvrtc.compile_cuda(k.source, "sm_90", ptx=False, extra_options=["--ptxas-options=-v"],
                             cache_dir=tmp_path).log
    regs = nvrtc.ptxas_registers(log)[k.name]
    record_property("registers", regs)
    record_property("shared_mem", k.shared_mem)
    assert k.name not in nvrtc.ptxas_spills(log), log
    assert regs <= 255 and 48 * 1024 < k.shared_mem <= 227 * 1024, (regs, k.shared_mem)


def test_flash_codegen_refuses_what_it_cannot_run():
    op, dts = _op(FlashCase("c", 2, 2, 256, 256), DType.bf16)
    with pytest.raises(CodegenError, match="tile_keys must be one of"):
        generate(op, ["p", "s"], arg_dtypes=dts, tile_keys=48)
    with pytest.raises(CodegenError, match="shared memory"):
        generate(op, ["p", "s"], arg_dtypes=dts, threads=1024)          # 512 rows of 256 features
    op, dts = _op(FlashCase("c", 2, 2, 24, 24), DType.bf16)
    with pytest.raises(CodegenError, match="multiples of 16"):
        generate(op, ["p", "s"], arg_dtypes=dts)


def test_flash_launch_asks_its_shared_memory_in_the_launch_table():
    from lum.builder.kernels import launch_table

    prog = flash_program([FlashCase("a", 1, 4, 128, 128), FlashCase("b", 2, 2, 16, 16)], DType.bf16, 64)
    from lum.builder.codegen import generate_program

    sources = generate_program(prog, ["p", "s"])
    table = launch_table(prog, sources, arch="sm_90", dyn_vars=["p", "s"])
    smem = [lc["shared_mem"] for o in table["ops"] if o["kind"] == "attention" for lc in o["launches"]]
    # 64 rows of q, 64 keys of k and v, each row padded by 16 bytes: d 128 asks above 48 KB, d 16 below it
    assert smem == [3 * 64 * (128 + 8) * 2, 3 * 64 * (16 + 8) * 2]


# ====================================================================== the kernel, on the host emulation
MAX_T = 128
BOUNDS = {"s": 80, "p": 40}
CASES = [FlashCase("gqa", 2, 2, 64, 64), FlashCase("sliding", 1, 4, 128, 128, "sliding", window=8),
         FlashCase("holes", 2, 3, 32, 48, "random", chunk=24), FlashCase("padded", 2, 2, 16, 32, pad=3),
         FlashCase("mha", 1, 1, 16, 16, "sliding", window=5)]
# (s, p): prompts of one row, shorter and longer than a tile (64 rows, 64 keys), a prompt after a past
RUNS = [(1, 0), (1, 7), (5, 0), (37, 0), (20, 13), (70, 0), (33, 40)]
VARIANTS = {"default": {}, "small": {"tile_keys": 16, "threads": 64}, "wide": {"tile_keys": 128}}
DTYPES = [DType.bf16, DType.f32, DType.f16]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Packages of the flash cases (every dtype x tiling) and of the tiny models in bf16, the fake driver, the
    emulated kernels (every kernel of those packages), the fake cuBLASLt."""
    from lum.builder.models import load_spec
    from lum.builder.package_builder import BuildOptions, build_package, write_program_package
    from tests import cuda_emulation as emu

    if emu.CC is None or emu.CXX is None:
        pytest.skip("no host C/C++ compiler for the CUDA emulation")
    try:
        from lum.builder import nvrtc

        nvrtc.nvrtc_version()
        import cuda.bindings.driver  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC or cuda-python missing: {exc}")
    root = tmp_path_factory.mktemp("flash")
    pkgs = {}
    for dt in DTYPES:
        prog = flash_program(CASES, dt, MAX_T)
        for name, tuning in VARIANTS.items():
            pkgs[f"{dt.value}.{name}"] = write_program_package(
                root / f"flash-{dt.value}-{name}.lumpkg", [prog], {"main": entry_for(prog, None, ("p", "s"))},
                model={"max_seq": MAX_T}, options=BuildOptions(kernel_tuning=tuning))
    for model in ("tiny-llama", "tiny-qwen3", "tiny-gemma3"):
        pkgs[model] = build_package(load_spec(random_name=model, dtype="bf16", max_seq=16), root / f"{model}.lumpkg")
    sources = []
    for name, path in pkgs.items():
        with lum.loader.open(path) as p:
            sources += emu.package_kernel_sources(p, VARIANTS.get(name.split(".")[-1]))
    return {"pkgs": {k: str(v) for k, v in pkgs.items()}, "driver": emu.fake_driver(root / "driver"),
            "kernels": emu.kernel_library(sources, root / "kernels"), "cublaslt": emu.fake_cublaslt(root / "lt")}


def _run(env, script: str):
    from tests import cuda_emulation as emu

    head = "from tests.flash_cases import FlashCase\nfrom lum.format.dtypes import DType\n"
    head += f"PKGS = {env['pkgs']!r}\nCASES = {CASES!r}\nMAX_T = {MAX_T}\nBOUNDS = {BOUNDS!r}\n"
    return emu.run_emulated(head + script, driver_dir=env["driver"], kernels=env["kernels"], cublaslt=env["cublaslt"])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_emulated_flash_attention_matches_the_reference(env, dt, variant):
    """Every case at every (s, p), the arena poisoned (NaN): the emulated kernel and its combine against the
    reference backend (the LLIR's semantics; f32 1e-5, 16-bit 1e-3: a probability may round to the next
    16-bit value where the f32 sums differ in their last bit) and against softmax attention in float64."""
    res = _run(env, f'''
import lum.loader as L
from tests.flash_cases import flash_inputs, flash_reference
from tests.kernel_cases import compare
dt = DType.parse({dt.value!r})
pkg = L.open(PKGS[{f"{dt.value}.{variant}"!r}])
ref = pkg.session(dyn=BOUNDS, backend="reference")
errors, checked, tuning = {{}}, 0, [o.tuning for g in pkg.manifest.groups for o in g.table.ops if o.kind == "attention"]
with pkg.session(dyn=BOUNDS, backend="cuda") as sess:
    for s, p in {RUNS!r}:
        ins = flash_inputs(CASES, dt, MAX_T, s, p, seed=s + 100 * p)
        want = ref.run("main", ins, {{"s": s, "p": p}})
        sess.runner.fill_arena(0xFF)
        got = sess.run("main", ins, {{"s": s, "p": p}})
        for c in CASES:
            k = c.name + ".y"
            checked += 1
            for tag, w, tol in (("reference", want[k], 1e-5 if dt == DType.f32 else 1e-3),
                                ("float64", flash_reference(c, ins, dt), 1e-5 if dt == DType.f32 else 1e-2)):
                err = compare(got[k], w, tol)
                if err:
                    errors[f"{{k}} s={{s}} p={{p}} vs {{tag}}"] = err
print(json.dumps({{"errors": errors, "checked": checked, "tuning": tuning, "stats": fake_stats()}}))
''')
    assert res["errors"] == {} and res["checked"] == len(RUNS) * len(CASES), res
    want = {"mma" if dt != DType.f32 else "fma"}
    assert {t["flash"] for t in res["tuning"]} == want, res["tuning"]
    keys = VARIANTS[variant].get("tile_keys", 64 if dt != DType.f32 else 32)
    assert {t["tile_keys"] for t in res["tuning"]} == {keys}
    # the d = 128 case's kernel asks more than 48 KB of shared memory but with the small tiles: the loader opted it in
    assert (res["stats"]["shared_optins"] > 0) == (variant != "small"), res["stats"]
    assert res["stats"]["live"] == [0] * 7 and res["stats"]["bad_guards"] == 0


@pytest.mark.parametrize("dt", [DType.bf16, DType.f32], ids=str)
def test_emulated_flash_attention_never_reads_a_tile_the_mask_hides_from_its_block(env, dt):
    """The key tiles a block's rows cannot see are skipped, not read: V (and K) rows there set to NaN leave that
    block's rows finite and right. 64-row blocks of the one-head 'mha' case (a window of 5 keys) at s = 70:
    with 16-key tiles the block of rows 0-63 never reads keys 64-69, the block of rows 64-69 never keys 0-47;
    with 64-key tiles (default bf16) the first block never reads keys 64-69 either."""
    res = _run(env, f'''
import lum.loader as L
from tests.flash_cases import flash_inputs, flash_reference
from tests.kernel_cases import compare
dt = DType.parse({dt.value!r})
case = next(c for c in CASES if c.name == "mha")
out = {{}}
for variant in ("small", "default"):
    pkg = L.open(PKGS[dt.value + "." + variant])
    with pkg.session(dyn=BOUNDS, backend="cuda") as sess:
        ins = flash_inputs(CASES, dt, MAX_T, 70, 0, seed=3)
        want = flash_reference(case, ins, dt)[0, 0]
        blocks = [(0, 64, range(64, 80))] + ([(64, 70, range(0, 48))] if variant == "small" else [])
        for lo, hi, hidden in blocks:
            poisoned = dict(ins)
            for x in ("k", "v"):
                a = ins["mha." + x].copy()
                a[list(hidden)] = np.nan
                poisoned["mha." + x] = a
            sess.runner.fill_arena(0xFF)
            got = sess.run("main", poisoned, {{"s": 70, "p": 0}})["mha.y"][0, 0]
            out[f"{{variant}} rows {{lo}}-{{hi}}"] = compare(got[lo:hi], want[lo:hi], 1e-2 if dt != DType.f32 else 1e-5)
print(json.dumps(out))
''')
    assert len(res) == 3 and all(v is None for v in res.values()), res


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_emulated_tiny_models_in_bf16_generate_the_reference_tokens_with_flash_prefill(env, model):
    """bf16 packages, whose prefill attention is the tensor-core flash kernel (its mma fallback here): greedy
    tokens equal the reference backend's, and the prefill logits agree."""
    res = _run(env, f'''
import lum.loader as L
from tests.kernel_cases import compare
pkg = L.open(PKGS[{model!r}])
flash = [o.tuning.get("flash") for g in pkg.manifest.groups if g.table for o in g.table.ops if o.kind == "attention"]
prompt = [1, 5, 9, 3, 17, 100, 7, 8, 2, 11]
ref = pkg.session(backend="reference")
want = ref.generate(prompt, 5)
with pkg.session(backend="cuda") as sess:
    got = sess.generate(prompt, 5)
    sess.reset()
    logits = sess.run("prefill", {{"tokens": np.asarray(prompt, np.int32)}}, {{"s": len(prompt)}})["logits"]
ref.reset()
want_logits = ref.run("prefill", {{"tokens": np.asarray(prompt, np.int32)}}, {{"s": len(prompt)}})["logits"]
print(json.dumps({{"want": want, "got": got, "flash": flash, "logits": compare(logits, want_logits, 1e-3)}}))
''')
    assert res["got"] == res["want"] and res["logits"] is None, res
    assert "mma" in res["flash"], res["flash"]
