"""What a kernel reads before its programmatic-launch wait, from its PTX and from its SASS.

Under programmatic dependent launch (templates/common.cuh) a kernel may read before
``griddepcontrol.wait`` only the dyn buffer (host copies fill it) and the buffers its launch table names
``early`` (weights, read-only: ``ld.global.nc``). Anything else read above the wait may not be written
yet by the kernel before. Two places can put a load there: the template (checked on the PTX) and ptxas,
which schedules ``ld.global.nc`` loads as read-only for the kernel's lifetime and did move a GEMV
prologue's loads above the wait once a preload shared the top of the kernel (benchmarks/NOTES.md,
10d0ece); checked by counting the SASS loads above ``ACQBULK`` against the PTX's, weight streams aside
(:func:`weight_stream`).
"""

from __future__ import annotations

import re

_PTX_ENTRY = re.compile(r"\.entry\s+(\w+)")
_PARAM = re.compile(r"ld\.param\.u64\s+(%rd\d+),\s*\[\w+_param_(\d+)\]")
_CVTA = re.compile(r"cvta\.to\.global\.u64\s+(%rd\d+),\s*(%rd\d+)")
_LOAD = re.compile(r"(?:ld\.global[\w.]*\s+[^\[]*|cp\.async[\w.:]*\s+\[[^\]]*\],\s*)\[(%rd\d+)(?:\+\d+)?\]")


def dyn_param_index(source: str, name: str) -> int:
    """The position of the ``dyn`` parameter in kernel ``name``'s C signature."""
    sig = source[source.index(name + "(") + len(name) + 1:]
    params = sig[:sig.index(")")].split(",")
    return next(i for i, p in enumerate(params) if p.split()[-1] == "dyn")


def ptx_loads_above_wait(ptx: str) -> dict[str, list[tuple[str, int | None]]]:
    """Entry -> (load, the parameter whose pointer it reads directly, else None) for every global load
    above the entry's first ``griddepcontrol.wait`` (entries that wait)."""
    out: dict[str, list[tuple[str, int | None]]] = {}
    parts = _PTX_ENTRY.split(ptx)
    for name, body in zip(parts[1::2], parts[2::2]):
        if "griddepcontrol.wait" not in body:
            continue
        param: dict[str, int] = {}
        loads = []
        for ln in body.split("griddepcontrol.wait")[0].splitlines():
            if m := _PARAM.search(ln):
                param[m.group(1)] = int(m.group(2))
            elif m := _CVTA.search(ln):
                if m.group(2) in param:
                    param[m.group(1)] = param[m.group(2)]
            elif m := _LOAD.search(ln):
                loads.append((ln.strip(), param.get(m.group(1))))
        out[name] = loads
    return out


def bad_ptx_loads(loads: dict[str, list[tuple[str, int | None]]], dyn: dict[str, int],
                  early: dict[str, bool]) -> dict[str, list[str]]:
    """The loads above a wait that break the rule: neither a read of the dyn buffer (parameter ``dyn[name]``)
    nor, in a kernel that reads early (``early[name]``: weights), a read-only one or a copy to shared memory
    (``cp.async``, a shared preload)."""
    bad = {}
    for name, lds in loads.items():
        wrong = [ln for ln, p in lds if p != dyn.get(name)
                 and not (early.get(name) and (".nc" in ln or ln.startswith("cp.async")))]
        if wrong:
            bad[name] = wrong
    return bad


def weight_stream(load: str) -> bool:
    """Whether a PTX or SASS load is a weight stream's (common.cuh lum_load_stream: ``ld.global.nc.L1::no_allocate``
    with an evict-first policy, ``LDG.E.NA…CONSTANT`` in SASS). lum issues it only for weights, which nothing writes
    while a graph runs, so ptxas may schedule it anywhere, above the wait too: it did, in llama3-1b's GEMVs as
    built (b5930dc, found once the tests marked the weights as ``lum build`` does)."""
    return "L1::no_allocate" in load or ".NA." in load


def sass_loads_above_wait(sass: str) -> dict[str, list[str]]:
    """Function -> its global loads above its first ``ACQBULK`` (``cuobjdump -sass``; functions that wait)."""
    out: dict[str, list[str]] = {}
    for fn in sass.split("Function : ")[1:]:
        if "ACQBULK" in fn:
            out[fn.split()[0]] = [ln.strip() for ln in fn.split("ACQBULK")[0].splitlines() if "LDG" in ln]
    return out
