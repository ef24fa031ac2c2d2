"""Sibling kernels as one launch (builder/siblings.py, templates/siblings.cu): which kernels are siblings,
what the fused kernel and its launch table look like, and the NVRTC compile. Results are checked on the
emulated driver (tests/test_cuda_emulated.py: every kernel case and the tiny models, its grid capped at
two blocks, so the virtual-block loop is exercised) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lum.builder.codegen import generate_program
from lum.builder.kernels import launch_table
from lum.builder.siblings import SIBLING_MAX_BLOCKS, fuse_siblings, sibling_kernels_enabled
from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker

N = 64


def _program(chain: bool = False, inplace: bool = False) -> Program:
    """Three elementwise ops on x (Exp2, Sin, Recip) after an input; ``chain``: the third reads the second's
    output; ``inplace``: the second writes its result into x's buffer (alias 0), which the others read."""
    v = ShapeTracker.contiguous((as_expr(N),))
    ops = [LOp(0, "input", "Input", (), (as_expr(N),), DType.f32, {"name": "x", "role": "input"}),
           LOp(1, "elementwise", "Exp2", (Arg(0, v),), (as_expr(N),), DType.f32, {}),
           LOp(2, "elementwise", "Sin", (Arg(0, v),), (as_expr(N),), DType.f32, {}, 0 if inplace else None),
           LOp(3, "elementwise", "Recip", (Arg(2 if chain else 0, v),), (as_expr(N),), DType.f32, {})]
    outs = [LOp(4 + k, "output", "Output", (Arg(i, v),), (as_expr(N),), DType.f32, {"name": f"y{i}", "role": "output"})
            for k, i in enumerate((1, 2, 3))]
    return Program("siblings", ops + outs)


def test_independent_small_kernels_in_a_row_are_one_launch():
    prog = _program()
    plain = generate_program(prog, [])
    fused = fuse_siblings(prog, plain, [], {})
    ks = fused[1]
    assert set(fused) - {1} == {i for i, k in plain.items() if k is None} and ks.tails == (2, 3)
    assert [p.name for p in ks.params] == ["out", "in0", "dyn", "t0_out", "t0_in0", "t1_out", "t1_in0"]
    grids = [plain[i].grid[0] for i in (1, 2, 3)]
    assert ks.grid[0] == grids[0] + grids[1] + grids[2] and ks.block == plain[1].block and not ks.early
    table = launch_table(prog, fused, arch="sm_90", dyn_vars=[])
    (entry,) = table["ops"]
    assert table["version"] == 2 and entry["tail"] == [2, 3] and table["programmatic"]
    assert entry["params"][3:] == ["out@2", "in0@2", "out@3", "in0@3"]
    assert "lum_v += gridDim.x" in ks.body and ks.body.count("lum_pdl_wait();") == 4    # the kernel's, each body's


def test_dependent_in_place_and_large_kernels_are_not_siblings():
    chain = _program(chain=True)                      # Recip reads Sin: Exp2 + Sin, then Recip alone
    fused = fuse_siblings(chain, generate_program(chain, []), [], {})
    assert fused[1].tails == (2,) and not fused[3].tails
    inplace = _program(inplace=True)                  # Sin overwrites x, which Exp2 and Recip read
    fused = fuse_siblings(inplace, generate_program(inplace, []), [], {})
    assert all(not k.tails for k in fused.values() if k is not None)
    big = _program()
    big = Program("big", [replace(o, shape=(as_expr(N * 16384),), args=tuple(
        Arg(a.src, ShapeTracker.contiguous((as_expr(N * 16384),))) for a in o.args)) for o in big.ops])
    gen = generate_program(big, [])
    assert max(int(k.grid[0].value) for k in gen.values() if k is not None) > SIBLING_MAX_BLOCKS
    assert all(not k.tails for k in fuse_siblings(big, gen, [], {}).values() if k is not None)


def test_siblings_regenerate_with_the_smallest_block_size(monkeypatch):
    """gemma's decode layer (the tiny model's): the k norm + RoPE + cache write, v-cache write and q norm + RoPE
    after the qkv GEMV are one launch, each at the smallest block size of the three."""
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import group_kernel_sources, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    cgs = compile_graph(build_entry(named_config("tiny-gemma3"), "decode", 64, DType.f32))
    dv = program_dyn_vars([cg.program for cg in cgs])
    layer = max(cgs, key=lambda cg: sum(o.kind == "scatter_nocopy" for o in cg.program.ops)).program
    monkeypatch.setenv("LUM_ATTENTION_STAGE", "0")      # else the attention kernel runs the three (attention_stage.py)
    monkeypatch.setenv("LUM_O_COMBINE", "0")            # and o the combine (o_combine.py): only siblings fuse here
    monkeypatch.setenv("LUM_SIBLING_KERNELS", "0")
    assert not sibling_kernels_enabled()
    plain = group_kernel_sources(layer, dv, {"p": 64})
    monkeypatch.delenv("LUM_SIBLING_KERNELS")
    assert sibling_kernels_enabled()        # the default
    fused = group_kernel_sources(layer, dv, {"p": 64})
    (sib,) = [k for k in fused.values() if k.tails and layer.ops[k.tails[0]].kind == "scatter_nocopy"]
    members = (next(i for i, k in fused.items() if k is sib), *sib.tails)
    kinds = sorted(layer.ops[i].kind for i in members)
    assert kinds == ["elementwise", "scatter_nocopy", "scatter_nocopy"], kinds
    assert sib.block[0] == min(plain[i].block[0] for i in members)
    assert len(fused) == len(plain) - sum(len(k.tails) for k in fused.values() if k.tails)  # and the residual's
    monkeypatch.setenv("LUM_SIBLING_KERNELS", "2")
    with pytest.raises(ValueError, match="LUM_SIBLING_KERNELS must be 0 or 1"):
        sibling_kernels_enabled()


@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_sibling_kernels_compile(nvrtc, tmp_path, arch):
    from lum.builder.codegen import module_source
    from tests.kernel_cases import template_cases
    for dt in (DType.f32, DType.bf16):
        prog = template_cases(dt)[0]
        fused = fuse_siblings(prog, generate_program(prog, ["s"], max_dyn={"s": 8}), ["s"], {"s": 8})
        assert sum(bool(k.tails) for k in fused.values() if k is not None) >= 5
        res = nvrtc.compile_cuda(module_source([k for k in fused.values() if k is not None]), arch, cache_dir=tmp_path)
        assert res.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("model,launches,gathered", [("llama3-1b", 1, DType.f32), ("gemma3-4b", 2, DType.bf16)])
def test_decode_step_starts_in_one_launch(model, launches, gathered, monkeypatch):
    """Decode's first group (the embedding gather, the RoPE tables, the mask) reads only inputs and constants:
    its positions and key indices are a constant table sliced at run time, not iota kernels, and the embedding's
    cast is the gather's (rules/fuse.egg fuse-gather-cast). So llama3-1b's is one sibling launch (with its input
    norms behind: ahead, the first layer's norm follows the gather, a second launch); gemma3-4b's scales the
    embedding after the gather, the cast inline there (two)."""
    if model == "llama3-1b":
        monkeypatch.setenv("LUM_NORMS_AHEAD", "0")
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import group_kernel_sources
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    first = compile_graph(build_entry(named_config(model), "decode", 512, DType.bf16))[0].program
    kernels = [k for k in group_kernel_sources(first, sorted(first.dyn_vars()), {"p": 511}).values() if k]
    assert not any(o.kind == "iota" for o in first.ops)
    assert [o.dtype for o in first.ops if o.kind == "gather"] == [gathered]
    assert len(kernels) == launches, [k.name for k in kernels]
