"""The CUDA backend's pure parts, on the CPU: launch tables (build → manifest → loader checks), target
compatibility, grid buckets and segments, pointer layout and kernel-parameter packing, the buffer
plan's in-place rules, session bounds, and that ``import lum.loader`` stays free of cuda-python.
(tests/test_cuda_emulated.py runs the whole backend on a host-emulated driver; tests/test_gpu.py on a GPU.)
"""

from __future__ import annotations

import copy
import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest

import lum.loader
from lum.builder.gemv_policy import gemv_rows
from lum.builder.kernels import compile_group_kernels, default_max_dyn, launch_table, program_dyn_vars
from lum.format.dtypes import DType
from lum.format.errors import PackageFormatError
from lum.format.expr import Var, as_expr, parse
from lum.format.manifest import Manifest
from lum.loader.cuda.branches import BRANCH_SLACK
from lum.loader.cuda.plan import Layout, ParamPack, bucket, build_entry_plan, is_flat_prefix
from lum.loader.cuda.target import check_target, parse_sm
from lum.loader.cuda.upload import pack
from lum.format.shapetracker import ShapeTracker
from lum.format.manifest import KERNEL_OP_KINDS
from tests.kernel_cases import BOUNDS, DYN, gemm_cases, template_cases, write_case_package

try:
    from lum.builder import nvrtc

    nvrtc.nvrtc_version()
    HAVE_NVRTC = True
except Exception:  # noqa: BLE001
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC (nvidia-cuda-nvrtc) is not installed")


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory):
    if not HAVE_NVRTC:
        pytest.skip("NVRTC is not installed")
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    path = build_package(load_spec(random_name="tiny-llama", max_seq=32), tmp_path_factory.mktemp("tl") / "t.lumpkg")
    return lum.loader.open(path)


@pytest.fixture(scope="module")
def tiny_pkg_apart(tmp_path_factory):
    """tiny-llama with its independent small kernels launched apart (``LUM_SIBLING_KERNELS=0``,
    ``LUM_ATTENTION_STAGE=0`` and ``LUM_O_COMBINE=0``; by default the k / v / q stage after qkv runs in the
    attention kernel, and the combine in o's): what graph branches schedule."""
    if not HAVE_NVRTC:
        pytest.skip("NVRTC is not installed")
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUM_SIBLING_KERNELS", "0")
        mp.setenv("LUM_ATTENTION_STAGE", "0")
        mp.setenv("LUM_O_COMBINE", "0")
        path = build_package(load_spec(random_name="tiny-llama", max_seq=32),
                             tmp_path_factory.mktemp("ta") / "t.lumpkg")
    return lum.loader.open(path)


# ============================================================================ build side
@needs_nvrtc
def test_build_writes_cubin_ptx_and_a_valid_launch_table(tiny_pkg):
    pkg = tiny_pkg
    m = pkg.manifest
    assert m.target["sm"] == "sm_90" and m.target["nvrtc"] == m.provenance["nvrtc"] == "%d.%d" % nvrtc.nvrtc_version()
    sections = {s.name: s for s in pkg.reader.sections}
    gemm_kernels = 0
    for k, (ref, prog) in enumerate(zip(m.groups, pkg.programs)):
        t = ref.table
        assert t is not None and t.arch == "sm_90" and t.dyn_vars == ("p", "s") and t.max_dyn == {"p": 32, "s": 32}
        kernel_ops = [o for o in prog.ops if o.kind in KERNEL_OP_KINDS or gemv_rows(o) is not None]
        tails = {i for k in t.ops for i in k.tail}              # ops a kernel runs too (builder/fused.py)
        assert sorted([k.op for k in t.ops] + sorted(tails)) == [o.id for o in kernel_ops]
        by_id = {o.id: o for o in prog.ops}
        gemm_kernels += sum(o.kind == "gemm" for o in kernel_ops)
        if kernel_ops:
            cub, ptx = sections[t.cubin], sections[t.ptx]
            assert cub.codec == "none" and cub.required and cub.kind == "cubin"
            assert ptx.codec == "zstd" and not ptx.required
            assert pkg.reader.section_bytes(t.cubin)[:4] == b"\x7fELF"
            text = pkg.reader.section_bytes(t.ptx).decode()
            assert ".target sm_90" in text
            for kop in t.ops:
                for lc in kop.launches:
                    assert f".entry {lc.kernel}(" in text     # every launch names an entry of the module
                    assert all(g.vars() <= {"p", "s"} for g in lc.grid)
        for kop in t.ops:
            op = by_id[kop.op]
            want = ("out",) + tuple(f"in{i}" for i in range(len(op.args))) + ("dyn",)
            for j in kop.tail:
                want += (f"out@{j}",) + tuple(f"in{i}@{j}" for i in range(len(by_id[j].args)))
            assert kop.kind == op.kind and kop.params == want
            assert len(kop.launches) == (2 if op.kind == "scatter" else 1)
    assert gemm_kernels > 0                               # decode's gemms (m = 1) are lum's own kernels


@needs_nvrtc
def test_launch_table_round_trips_through_the_manifest(tiny_pkg):
    m = tiny_pkg.manifest
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())), set(tiny_pkg.reader.names()))
    assert [g.table for g in again.groups] == [g.table for g in m.groups]


def _manifest_with(tiny_pkg, mutate) -> dict:
    d = copy.deepcopy(tiny_pkg.manifest.to_json())
    mutate(d["groups"][1]["kernels"], d)
    return d


@needs_nvrtc
@pytest.mark.parametrize("mutate,match", [
    (lambda t, d: t.update(version=4), "kernel table version"),
    (lambda t, d: t["ops"][0]["launches"][0].update(cluster=2), "clusters need table version 3"),
    (lambda t, d: (t.update(version=3), t["ops"][0]["launches"][0].update(cluster=16)), "integer in \\[2, 8\\]"),
    (lambda t, d: (t.update(version=3), t["ops"][0]["launches"][0].update(cluster=1)), "integer in \\[2, 8\\]"),
    (lambda t, d: ([g["kernels"].update(arch="sm_80") for g in d["groups"] if g["kernels"]], t.update(version=3),
                   d["target"].update(sm="sm_80"), t["ops"][0]["launches"][0].update(cluster=2)), "need sm_90 or newer"),
    (lambda t, d: t.update(arch="sm_80"), "targets"),
    (lambda t, d: t["ops"][0]["launches"][0].update(kernel="bad name;"), "C identifier"),
    (lambda t, d: t["ops"][0]["launches"][0].update(grid=["q + 1", "1", "1"]), "not in dyn_vars"),
    (lambda t, d: t["ops"][0]["launches"][0].update(grid=["1", "1"]), "3 dimensions"),
    (lambda t, d: t["ops"][0]["launches"][0].update(block=[1024, 2, 1]), "exceeds 1024"),
    (lambda t, d: t["ops"][0].update(params=["in0", "out", "dyn"]), "expected \\['out'"),
    (lambda t, d: t["ops"].reverse(), "sorted"),
    (lambda t, d: t.update(cubin="cubin/nope"), "missing section"),
    (lambda t, d: t.update(cubin=None), "names no cubin"),
    (lambda t, d: t.update(dyn_vars=["p", "p"]), "duplicate"),
    (lambda t, d: t["max_dyn"].update(z=3), "not in dyn_vars"),
    (lambda t, d: t["ops"][0].update(kind="matmul"), "not a kernel op kind"),
    (lambda t, d: d["target"].update(sm="hopper"), "architecture like"),
    (lambda t, d: t.update(programmatic="yes"), "expected true or false"),
    (lambda t, d: t["ops"][0].update(early=["out"]), "not input parameters"),
    (lambda t, d: t["ops"][0].update(early=["in9"]), "not input parameters"),
])
def test_manifest_rejects_bad_launch_tables(tiny_pkg, mutate, match):
    with pytest.raises(PackageFormatError, match=match):
        Manifest.from_json(_manifest_with(tiny_pkg, mutate), set(tiny_pkg.reader.names()))


def _repacked(pkg, manifest: dict, path):
    """``pkg``'s sections under another manifest, written to ``path``."""
    from lum.format.package import PackageWriter

    w = PackageWriter()
    for s in pkg.reader.sections:
        if s.name != "manifest":
            w.add_section(s.name, pkg.reader.section_bytes(s.name), codec=s.codec, kind=s.kind, required=s.required)
    w.set_manifest(manifest)
    return w.write(path)


@needs_nvrtc
def test_loader_checks_launch_table_against_llir(tiny_pkg, tmp_path):
    def rewrite(mutate, name):
        return _repacked(tiny_pkg, _manifest_with(tiny_pkg, mutate), tmp_path / name)

    first = tiny_pkg.manifest.groups[1].table.ops[0].op
    bad = rewrite(lambda t, d: t["ops"].pop(0), "missing.lumpkg")
    with pytest.raises(PackageFormatError, match=f"op {first} .* has no kernel"):
        lum.loader.open(bad)
    def one_more_in(t, d):
        params = t["ops"][0]["params"]
        params.insert(params.index("dyn"), f"in{params.index('dyn') - 1}")

    bad = rewrite(one_more_in, "arity.lumpkg")
    with pytest.raises(PackageFormatError, match="does not match the LLIR"):
        lum.loader.open(bad)
    bad = rewrite(lambda t, d: t["ops"][0].update(kind="gemm"), "kind.lumpkg")   # a table may name gemms, but
    with pytest.raises(PackageFormatError, match="does not match the LLIR"):      # only for gemm ops
        lum.loader.open(bad)
    ok = rewrite(lambda t, d: None, "same.lumpkg")
    lum.loader.open(ok).close()


@needs_nvrtc
def test_a_fused_gemm_without_its_kernel_is_rejected(tiny_pkg, tmp_path):
    """A gemm with a prologue or an epilogue has no library fallback: a launch table without its kernel is
    a format error, as for any kernel op (a plain gemm may leave its table entry out: cuBLASLt)."""
    from lum.format.llir import gemm_fused

    fused = [(g, o) for g, prog in enumerate(tiny_pkg.programs) for o in prog.ops if gemm_fused(o)]
    assert any("expr" in o.params for _, o in fused) and any("epilogue" in o.params for _, o in fused)
    for g, o in fused:
        d = copy.deepcopy(tiny_pkg.manifest.to_json())
        table = d["groups"][g]["kernels"]
        table["ops"] = [k for k in table["ops"] if k["op"] != o.id]
        with pytest.raises(PackageFormatError, match=f"op {o.id} .* has no kernel"):
            lum.loader.open(_repacked(tiny_pkg, d, tmp_path / f"g{g}-{o.id}.lumpkg"))


def test_launch_table_is_pure_and_follows_the_convention():
    from lum.builder.codegen import generate_program

    prog, _, _ = template_cases(DType.f32)
    dv = program_dyn_vars([prog])
    assert dv == ["s"]
    sources = {i: k for i, k in generate_program(prog, dv, max_dyn={"s": 8}).items() if k is not None}
    t = launch_table(prog, sources, arch="sm_90", dyn_vars=dv, max_dyn={"s": 8})
    assert t["version"] == 1 and t["max_dyn"] == {"s": 8} and len(t["ops"]) == len(sources)
    for entry in t["ops"]:
        op = prog.ops[entry["op"]]
        assert entry["params"] == ["out"] + [f"in{k}" for k in range(len(op.args))] + ["dyn"]
        for lc in entry["launches"]:
            assert [parse(g) for g in lc["grid"]] and lc["block"][0] == entry["tuning"]["threads"]
    with pytest.raises(ValueError, match="dyn slots"):
        launch_table(prog, sources, arch="sm_90", dyn_vars=["p", "s"])
    assert default_max_dyn(["p", "s", "b"], 64) == {"p": 64, "s": 64}
    assert default_max_dyn(["s"], 0) == {}


@needs_nvrtc
def test_group_without_kernels_gets_an_empty_table():
    prog, _, _ = gemm_cases(DType.f32)
    gk = compile_group_kernels(prog, arch="sm_90", dyn_vars=["s"])
    assert gk.cubin is None and gk.table["ops"] == []


def test_import_lum_loader_does_not_import_cuda():
    code = ("import sys, lum.loader, lum.loader.model, lum.loader.reference_backend, lum.loader.inspect; "
            "bad = [m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'lum.loader.cuda'))]; "
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ============================================================================ target
@pytest.mark.parametrize("sm,cc,driver,has_ptx,allow,ok,ptx,match", [
    ("sm_90", (9, 0), 13000, True, True, True, False, "matches"),
    ("sm_90", (9, 0), 12080, True, True, False, False, "need a CUDA 13 driver"),
    ("sm_90", (8, 0), 13000, True, True, False, False, "older"),
    ("sm_90", (10, 0), 13000, True, True, True, True, "JIT"),
    ("sm_90", (10, 0), 13000, True, False, False, False, "rebuild"),
    ("sm_90", (10, 0), 13000, False, True, False, False, "no PTX"),
    ("sm_90a", (10, 0), 13000, True, True, False, False, "architecture-specific"),
    ("sm_90", (12, 0), 12090, True, True, False, False, "need a CUDA 13 driver|driver too old"),
])
def test_target_compatibility(sm, cc, driver, has_ptx, allow, ok, ptx, match):
    c = check_target(sm, "13.0", cc, driver, has_ptx, "GPU", allow)
    assert (c.ok, c.use_ptx) == (ok, ptx), c.reason
    assert __import__("re").search(match, c.reason), c.reason
    assert parse_sm("sm_100a") == (10, 0, "a") and parse_sm("sm_120") == (12, 0, "")


# ============================================================================ plans
def test_bucket_rounds_up_to_powers_of_two_within_the_cap():
    assert [bucket(g, 100) for g in (1, 2, 3, 5, 9, 64, 65, 100)] == [1, 2, 4, 8, 16, 64, 100, 100]
    assert bucket(130, 100) == 130            # above the cap (a bigger run than planned): exact
    assert bucket(7, 4) == 7


def test_param_pack_is_a_void_pointer_array():
    pp = ParamPack([0x1000, 0xDEADBEEF000, 0])
    assert pp.read_back() == (0x1000, 0xDEADBEEF000, 0)
    ptrs = (ctypes.c_void_p * 3).from_address(pp.address)
    assert ptrs[1] - ptrs[0] == 8               # each points at its 8-byte value


def test_is_flat_prefix():
    s = Var("s")
    assert is_flat_prefix(ShapeTracker.contiguous((s, 64)))
    assert is_flat_prefix(ShapeTracker((as_expr(1), as_expr(64)), (as_expr(0), as_expr(1)), as_expr(0)))
    assert not is_flat_prefix(ShapeTracker.contiguous((s, 64)).permute((1, 0)))
    assert not is_flat_prefix(ShapeTracker.contiguous((s + 1, 64)).slice(0, 1, s + 1))
    assert not is_flat_prefix(ShapeTracker.contiguous((s, 60)).pad(1, 0, 4))


def test_pack_aligns_and_keeps_order():
    lay = pack({"a": 10, "b": 0, "c": 300})
    assert lay.offsets == {"a": 0, "b": 256, "c": 512} and lay.total == 1024


def _fake_layout(pkg, entry, bounds, base=1 << 40):
    """Addresses as a session would lay them out, without a driver."""
    m = pkg.manifest
    ap = pkg.plan(entry, bounds, BRANCH_SLACK)    # as the runner plans it with graph branches on
    wl = pack({n: int(np.prod(w.shape)) * w.dtype.itemsize for n, w in m.weights.items()})
    sl = pack({n: int(np.prod(t.concrete_shape({}))) * t.dtype.itemsize for n, t in m.state.items()})
    wbase, sbase, cbase, dbase = base + (1 << 36), base + (2 << 36), base + (3 << 36), base + (4 << 36)
    io = {}
    pos = (ap.size + 255) // 256 * 256
    for t in m.entries[entry].inputs:
        n = int(np.prod(t.concrete_shape(bounds))) * t.dtype.itemsize
        io[t.name] = (pos, n)
        pos += (max(n, 1) + 255) // 256 * 256
    consts, cbytes = {}, {}
    for g, prog in enumerate(pkg.programs):
        for op in prog.ops:
            if op.kind == "constant":
                consts[(g, op.id)] = cbase + 256 * len(consts)
                cbytes[(g, op.id)] = 256
    orders = {g.table.dyn_vars for g in m.groups if g.table is not None}
    layout = Layout(base, ap.offsets, ap.sizes, {n: wbase + o for n, o in wl.offsets.items()}, wl.sizes,
                    {n: sbase + o for n, o in sl.offsets.items()}, sl.sizes,
                    {n: base + o for n, (o, _) in io.items()}, {n: s for n, (_, s) in io.items()},
                    consts, cbytes, {o: dbase + 64 * i for i, o in enumerate(sorted(orders))})
    return layout, ap


@needs_nvrtc
def test_programmatic_launch_only_where_early_reads_are_weights(tiny_pkg, monkeypatch):
    """A programmatic table's kernels launch with programmatic stream serialization when the session asks
    for it, except a kernel that reads a buffer before its wait (``early``) that is not a weight: an
    activation written by the kernel before it must not be read early."""
    import dataclasses

    pkg = tiny_pkg
    bounds = {"p": 31}
    layout, _ = _fake_layout(pkg, "decode", bounds)
    tables = {g: ref.table for g, ref in enumerate(pkg.manifest.groups) if ref.table is not None}
    assert all(t.programmatic for t in tables.values())

    def flags(programmatic):
        plan = build_entry_plan(pkg, "decode", layout, lambda g, name: (g, name), bounds, programmatic=programmatic)
        return {k.where: k.programmatic for k in plan.steps if type(k).__name__ == "KernelStep"}

    assert not any(flags(False).values()) and all(flags(True).values())
    monkeypatch.setattr(pkg.manifest, "groups", list(pkg.manifest.groups))   # restored after the test
    for g, t in tables.items():           # every gemv reads its B early, and one also its A (an activation)
        gemvs = [k for k in t.ops if k.kind == "gemm"]
        ops = {k.op: dataclasses.replace(k, early=("in1",)) for k in gemvs}
        if gemvs:
            ops[gemvs[0].op] = dataclasses.replace(gemvs[0], early=("in0", "in1"))
        pkg.manifest.groups[g] = dataclasses.replace(
            pkg.manifest.groups[g], table=dataclasses.replace(t, ops=tuple(ops.get(k.op, k) for k in t.ops)))
    got = flags(True)
    early_a = {w for w, on in got.items() if not on}
    assert early_a and all("(gemm " in w for w in early_a)
    assert sum("(gemm " in w for w in got) > len(early_a)     # B alone (a weight) stays programmatic


@needs_nvrtc
def test_decode_plan_pointers_segments_and_keys(tiny_pkg):
    pkg = tiny_pkg
    bounds = {"p": 31}
    layout, ap = _fake_layout(pkg, "decode", bounds)
    fns = []
    plan = build_entry_plan(pkg, "decode", layout, lambda g, name: fns.append((g, name)) or (g, name), bounds)
    kernels = [s for s in plan.steps if type(s).__name__ == "KernelStep"]
    gemv = [k for k in kernels if "(gemm " in k.where]
    assert kernels and len(fns) == len(kernels)
    # every decode gemm has a static m (1, or the query heads of a KV head): lum's gemv kernel, no library call
    assert gemv and not [s for s in plan.steps if type(s).__name__ == "GemmStep"]
    att = [k for k in kernels if "(attention " in k.where or "_stage_" in k.function[1]]   # the stage: its head's op
    assert att and all("p" in plan.grid_exprs[k.grid[0]].vars() for k in att)   # its chunks: cdiv(p + 1, 16)
    lo, hi = layout.arena, layout.arena + ap.size
    state = {v: (p, p + layout.state_bytes[v]) for v, p in layout.state.items()}
    nocopy, fed = 0, []
    kops = {lc.kernel: (g, kop) for g, ref in enumerate(pkg.manifest.groups) if ref.table is not None
            for kop in ref.table.ops for lc in kop.launches}
    for k in kernels:
        g, kop = kops[k.function[1]]
        kinds = {o.id: o.kind for o in pkg.programs[g].ops}
        vals = list(k.params.values)
        n_head = len(kop.head_params)
        assert vals[n_head - 1] == layout.dyn[("p", "s")]
        # the head's (out, ins…), then each tail's (out, ins…), in the order the kernel runs them
        parts = [(kop.op, vals[:n_head - 1])]
        pos = n_head
        for t, n in zip(kop.tail, kop.tail_arities()):
            parts.append((t, vals[pos:pos + 1 + n]))
            pos += 1 + n
        assert pos == len(vals)
        for op_id, (out, *ins) in parts:
            if kinds[op_id] == "scatter_nocopy":  # the KV-cache write lands in the state allocation
                nocopy += 1
                assert any(a <= out < b for a, b in state.values()) and out == ins[0]
            elif out == layout.inputs["tokens"]:    # next_token, into the next step's input slot (plan.FEEDBACK)
                fed.append(k.where)
            else:
                assert lo <= out < hi, k.where
        assert k.params.read_back() == k.params.values
    (out_token,) = [o for o in plan.outputs if o.name == "next_token"]
    assert len(fed) == 1 and out_token.ptr == layout.inputs["tokens"]
    assert nocopy == 2 * len([c for c in pkg.entry("decode").calls if "k_cache" in " ".join(c.inputs)])
    # attention's gemms read p from the dyn buffer: nothing is volatile, every segment is a graph whose
    # key changes only when a grid crosses a bucket as p grows
    assert not any(plan.volatile(st) for st in plan.steps) and len(plan.segments) == 1
    graph_keys = [[seg.key(plan.values({"p": p})) for seg in plan.segments] for p in range(32)]
    assert len({tuple(k) for k in graph_keys}) <= 6
    assert all(o[0] == "kernel" for o in plan.concrete(plan.values({"p": 9}), lambda spec: spec))
    plan.check({"p": 31})
    with pytest.raises(lum.loader.SessionError, match="planned"):
        plan.check({"p": 40})


@needs_nvrtc
def test_a_chained_step_writes_its_token_where_the_next_step_reads_it(tiny_pkg):
    """``feedback_to`` puts decode's next_token at that address (a step chain's next log slot) and nothing
    else moves; decode can chain (one token input fed back, one segment, no dyn-sized library call),
    prefill cannot (its GEMMs' sizes follow s)."""
    from lum.loader.cuda.chain import chainable

    pkg = tiny_pkg
    bounds = {"p": 31}
    layout, _ = _fake_layout(pkg, "decode", bounds)
    plain = build_entry_plan(pkg, "decode", layout, lambda g, name: (g, name), bounds)
    target = layout.arena - 4096
    fed = build_entry_plan(pkg, "decode", layout, lambda g, name: (g, name), bounds, feedback_to=target)
    outs = {o.name: o.ptr for o in fed.outputs}
    assert outs["next_token"] == target
    assert {o.name: o.ptr for o in plain.outputs}["next_token"] == layout.inputs["tokens"]
    moved = [b for a, b in zip(plain.steps, fed.steps) if a.params.values != b.params.values]
    assert len(moved) == 1 and target in moved[0].params.values       # only the argmax's last kernel
    assert chainable(plain)
    pre_layout, _ = _fake_layout(pkg, "prefill", {"s": 16})
    assert not chainable(build_entry_plan(pkg, "prefill", pre_layout, lambda g, name: (g, name), {"s": 16}))


@needs_nvrtc
def test_small_m_gemm_is_a_kernel_step_with_bounds_checks(tmp_path):
    """x[1, 16] @ B^T with B [8, 16] (a fixed-size cache) and n = s + 1: lum's gemv kernel, launched with
    (out, A, B, dyn); its reads are checked per run like a library call's (here: B has 8 rows)."""
    from tests.kernel_cases import S, _Builder, _gemm_case

    b = _Builder()
    _gemm_case(b, np.random.default_rng(0), "g", "RmCm", (DType.f32,) * 3, 1, S + 1, 16, 1, n_cap=8)
    prog = b.program("gemv")
    pkg = lum.loader.open(write_case_package(tmp_path / "gemv.lumpkg", prog, b))
    (ref,) = pkg.manifest.groups
    (gemm,) = [o for o in prog.ops if o.kind == "gemm"]
    assert [k.op for k in ref.table.ops] == [gemm.id] and ref.table.ops[0].kind == "gemm"
    layout, _ = _fake_layout(pkg, "main", {"s": 8})
    plan = build_entry_plan(pkg, "main", layout, lambda g, name: name, {"s": 8})
    (step,) = plan.steps
    assert type(step).__name__ == "KernelStep" and step.function == ref.table.ops[0].launches[0].kernel
    assert step.params.values == (layout.arena + layout.offsets[f"c0.{gemm.id}"], layout.inputs["g.x0"],
                                  layout.inputs["g.x1"], layout.dyn[("s",)])
    assert "s" in plan.grid_exprs[step.grid[0]].vars()
    plan.check({"s": 7})                                     # n = 8: the last row of B
    with pytest.raises(lum.loader.SessionError, match="operand B"):
        plan.check({"s": 8})


@needs_nvrtc
def test_prefill_plan_copies_scattered_caches_into_state(tiny_pkg):
    pkg = tiny_pkg
    bounds = {"s": 32}
    layout, ap = _fake_layout(pkg, "prefill", bounds)
    plan = build_entry_plan(pkg, "prefill", layout, lambda g, n: (g, n), bounds)
    copies = [s for s in plan.steps if type(s).__name__ == "CopyStep"]
    uses_copy = any(o.kind == "scatter" for p in pkg.programs for o in p.ops)
    if uses_copy:
        assert copies and all(c.dst in layout.state.values() for c in copies)
    out = plan.outputs[0]
    assert out.name == "logits" and layout.arena <= out.ptr < layout.arena + ap.size
    # prefill's gemms (m = s) stay cuBLASLt calls, sized per run
    gemms = [s for s in plan.steps if type(s).__name__ == "GemmStep"]
    assert gemms and all(plan.volatile(g) for g in gemms)
    ops = plan.concrete(plan.values({"s": 9}), lambda spec: spec)
    specs = [o[1] for o in ops if o[0] == "gemm"]
    assert len(specs) == len(gemms) and all(sp.m in (9, 18) for sp in specs)   # s, or s query heads per KV head
    for o in ops:
        if o[0] == "gemm":
            assert o[2] % 256 == 0 and o[3] % 256 == 0        # operand bases (the library adds offsets)
    # one captured graph per prompt length: the key holds the exact sizes the library calls bake in
    (seg,) = plan.segments
    keys = {s: seg.key(plan.values({"s": s})) for s in (8, 9, 16, 17)}
    assert len(set(keys.values())) == 4 and keys[9] == seg.key(plan.values({"s": 9}))


@needs_nvrtc
def test_buffers_give_in_place_state_writes_no_arena_space(tiny_pkg):
    pkg = tiny_pkg
    names = {b.name for b in pkg.buffers("decode")}
    for c, call in enumerate(pkg.entry("decode").calls):
        for op in pkg.programs[call.group].ops:
            if op.kind == "scatter_nocopy":
                assert f"c{c}.{op.id}" not in names
    plan = pkg.buffers("decode")
    last = max(b.last for b in plan)
    logits = [b for b in plan if b.name == "logits"]
    assert logits and logits[0].last == last    # an entry output lives until the run ends


@needs_nvrtc
def test_session_bounds_default_from_max_seq(tiny_pkg):
    from lum.loader.cuda.runner import session_bounds

    assert session_bounds(tiny_pkg, {}) == {"decode": {"p": 31}, "prefill": {"s": 32}}
    assert session_bounds(tiny_pkg, {"s": 7}) == {"decode": {"p": 31}, "prefill": {"s": 7}}
    with pytest.raises(lum.loader.SessionError, match="negative"):
        session_bounds(tiny_pkg, {"p": -1})


def test_kernel_case_programs_run_on_the_reference_backend(tmp_path):
    for fn in (template_cases, gemm_cases):
        prog, arrays, b = fn(DType.f32)
        path = write_case_package(tmp_path / f"{fn.__name__}.lumpkg", prog, b, compile_kernels=False)
        sess = lum.loader.open(path).session(dyn=BOUNDS, backend="reference")
        sess.load_state(b.state_init)
        out = sess.run("main", arrays, DYN)
        assert len(out) == len(prog.outputs())          # the state cache is an entry output too
        assert not any(np.isnan(np.asarray(v, dtype=np.float64)).any() for v in out.values())  # log2(padding) = -inf


def test_cuda_backend_refuses_a_package_without_kernels(tmp_path):
    prog, arrays, b = template_cases(DType.f32)
    path = write_case_package(tmp_path / "nok.lumpkg", prog, b, compile_kernels=False)
    pkg = lum.loader.open(path)
    sess = pkg.session(dyn=BOUNDS, backend="auto")
    assert sess.backend == "reference" and sess.backend_reason.startswith("reference backend, because")
    with pytest.raises((lum.loader.BackendUnavailableError, lum.format.errors.IncompatibleTargetError)):
        pkg.session(dyn=BOUNDS, backend="cuda")


# ============================================================================ graph branches
@needs_nvrtc
@pytest.mark.parametrize("entry", ["prefill", "decode"])
@pytest.mark.parametrize("fused", [True, False])
def test_graph_branches_order_every_dependent_pair(tiny_pkg, tiny_pkg_apart, entry, fused):
    """The streams a graph is captured from (loader/cuda/branches.py) order every pair of steps that
    share bytes with a write, and still leave independent kernels side by side in decode where they are
    launched apart; by default (``fused``) the k / v / q stage runs in the attention kernel, whose tails its
    steps' buffers include."""
    from lum.loader.cuda.branches import EVERYTHING, conflicts, happens_before

    pkg = tiny_pkg if fused else tiny_pkg_apart
    assert any(k.tail for ref in pkg.manifest.groups for k in ref.table.ops) == fused
    bounds = {"s": 16} if entry == "prefill" else {"p": 31}
    layout, _ = _fake_layout(pkg, entry, bounds)
    plan = build_entry_plan(pkg, entry, layout, lambda g, name: (g, name), bounds)
    (seg,) = plan.segments
    sched = seg.schedule
    kernel = [type(st).__name__ == "KernelStep" for st in seg.steps]
    reads = [st.reads if k else EVERYTHING for st, k in zip(seg.steps, kernel)]
    writes = [st.writes if k else EVERYTHING for st, k in zip(seg.steps, kernel)]
    before = happens_before(sched)
    n = len(seg.steps)
    pairs = [(j, i) for i in range(n) for j in range(i) if conflicts(reads, writes, j, i)]
    assert pairs and all(j in before[i] for j, i in pairs)
    # every wait is on an event the schedule records, and every side stream joins back
    assert all(w in sched.signals for p in sched.placements for w in p.waits)
    last = {p.stream: i for i, p in enumerate(sched.placements)}
    assert sorted(sched.tails) == sorted(i for s, i in last.items() if s)
    # a side stream starts only with a wait (that is how it joins the capture)
    first = {}
    for i, p in enumerate(sched.placements):
        first.setdefault(p.stream, p)
    assert all(p.waits for s, p in first.items() if s)
    if entry == "decode" and not fused:
        parallel = [(j, i) for i in range(n) for j in range(i) if j not in before[i]]
        assert sched.streams > 1 and parallel           # e.g. the v-cache write beside the k path


def test_graph_branches_schedule_small_cases():
    from lum.loader.cuda.branches import EVERYTHING, happens_before, schedule

    # a -> (b, c) -> d : b and c read a's output and write their own; d reads both
    reads = [(), ((0, 8),), ((0, 8),), ((8, 16), (16, 24))]
    writes = [((0, 8),), ((8, 16),), ((16, 24),), ((24, 32),)]
    s = schedule(reads, writes)
    hb = happens_before(s)
    assert 1 not in hb[2] and 2 not in hb[1] and {0, 1, 2} <= hb[3] and s.streams == 2
    # write-after-read: c overwrites what b reads
    s = schedule([(), ((0, 8),), ()], [((0, 8),), ((8, 16),), ((0, 8),)])
    assert 1 in happens_before(s)[2]
    # a barrier orders everything; one stream suffices without independence
    s = schedule([(), EVERYTHING, ()], [((0, 8),), EVERYTHING, ((8, 16),)])
    assert happens_before(s)[2] == {0, 1}
    assert schedule([(), ((0, 8),)], [((0, 8),), ((8, 16),)]).streams == 1
    # at most max_streams streams, still correct
    reads = [()] + [((0, 8),)] * 6 + [tuple((8 * k, 8 * k + 8) for k in range(1, 7))]
    writes = [((0, 8),)] + [((8 * k, 8 * k + 8),) for k in range(1, 7)] + [((64, 72),)]
    s = schedule(reads, writes, max_streams=3)
    assert s.streams == 3 and set(range(7)) <= happens_before(s)[7]


def test_a_kernel_opts_in_where_its_static_and_dynamic_shared_memory_pass_48_kb(monkeypatch):
    """The loader raises a kernel's limit of dynamic shared memory where what it asks passes 48 KB alone or
    beside its static shared memory (24 KB static, 33 KB dynamic), and leaves it where both fit: the driver's
    default limit is 48 KB less the static part."""
    from types import SimpleNamespace as NS

    cu = pytest.importorskip("lum.loader.cuda.driver")
    static = {"a": 24 * 1024, "b": 0}
    raised: list[tuple[str, int]] = []
    attrs = NS(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="static", CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max")
    monkeypatch.setattr(cu, "drv", NS(CUfunction_attribute=attrs, cuModuleGetFunction=lambda h, n: (0, n.decode()),
                                      cuFuncGetAttribute=lambda a, f: (0, static[f] if a == "static" else -1),
                                      cuFuncSetAttribute=lambda f, a, v: (raised.append((f, v)), 0)[1]))
    mod = object.__new__(cu.Module)
    mod.handle, mod.what, mod._functions, mod._shared = 1, "test", {}, {}
    assert mod.function("a", 33 * 1024) == "a" and raised == [("a", 33 * 1024)]
    assert mod.function("a", 33 * 1024) == "a" and len(raised) == 1        # raised once
    mod.function("b", 33 * 1024)
    mod.function("b")
    assert len(raised) == 1                                                   # 33 KB and no static part: fits
    mod.function("b", 100 * 1024)
    assert raised[-1] == ("b", 100 * 1024)
