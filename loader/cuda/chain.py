"""Several greedy decode steps as one CUDA graph.

Between two graph launches the device idles: the next graph starts only once the last one has finished,
with nothing launched ahead, while inside a graph each kernel is scheduled while the one before still runs
(programmatic launch). A :class:`StepChain` captures ``count`` decode steps in one graph, so only one in
``count`` step boundaries is a graph boundary. Each step of the chain has its own plan
(:func:`~lum.loader.cuda.plan.build_entry_plan`) over the session's arena, weights and state; what differs
is where it reads its dyn values (a slot set of its own, all written by one copy before the launch) and
its token: step i reads ``log[i]`` and writes its ``next_token`` into ``log[i + 1]`` (the plan's feedback
address; ``log`` is [count + 1] i32), so the chain's tokens are ``log[1:]`` when it ends, and no copy runs
between its steps.

The chain's graph is keyed by its steps' keys (their bucketed grids), and cached like the runner's.
An entry can chain when it takes exactly the token input of :data:`~lum.loader.cuda.plan.FEEDBACK` and
outputs its token, and its plan is one segment with no step whose sizes depend on dyn values.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from lum.format.dtypes import DType
from lum.loader.cuda import driver as cu
from lum.loader.cuda.arrays import DeviceArray
from lum.loader.cuda.plan import FEEDBACK, EntryPlan, build_entry_plan
from lum.loader.cuda.runner import _Slot
from lum.loader.errors import SessionError

__all__ = ["StepChain", "chainable"]


def chainable(plan: EntryPlan) -> bool:
    """Whether ``plan``'s steps can be chained (see the module docstring)."""
    out_name, in_name = FEEDBACK
    outs = {o.name: o for o in plan.outputs}
    return ([r.name for r in plan.inputs] == [in_name] and out_name in outs
            and outs[out_name].ptr == plan.inputs[0].ptr and len(plan.segments) == 1
            and not any(plan.volatile(st) for st in plan.steps))


class StepChain:
    """``count`` steps of ``entry`` captured as one graph (see the module docstring). ``runner``: the
    :class:`~lum.loader.cuda.runner.CudaRunner` whose memory the steps share."""

    def __init__(self, runner: Any, entry: str, count: int):
        if count < 2:
            raise ValueError("a step chain has at least two steps")
        self.runner, self.entry, self.count = runner, entry, int(count)
        layout = runner.layouts[entry]
        self.dyn_bytes = runner.dyn_buf.nbytes                     # one slot set: every kernel table's order
        self.dyn = runner._own(cu.DeviceBuffer(self.dyn_bytes * self.count, "chained dyn values"))
        self.log = runner._own(cu.DeviceBuffer(4 * (self.count + 1), "chained tokens"))
        self._orders = {o: p - runner.dyn_buf.ptr for o, p in runner.dyn_ptrs.items()}
        in_name = FEEDBACK[1]
        self.plans: list[EntryPlan] = []
        for i in range(self.count):
            lay = dataclasses.replace(
                layout, dyn={o: self.dyn.ptr + i * self.dyn_bytes + off for o, off in self._orders.items()},
                inputs={in_name: self.log.ptr + 4 * i}, input_bytes={in_name: 4})
            self.plans.append(build_entry_plan(runner.pkg, entry, lay, runner._function, runner.bounds[entry],
                                               runner.gemm_algos, runner.programmatic,
                                               feedback_to=self.log.ptr + 4 * (i + 1)))
        self._stage = [runner._own(_Slot(self.dyn_bytes * self.count)) for _ in range(2)]
        self._turn = 0
        self._graphs: OrderedDict = OrderedDict()
        self.captures = 0
        self.error: str | None = None           # why the last capture failed

    def run(self, first: DeviceArray, dyn: Mapping[str, int], var: str) -> DeviceArray:
        """The chain's tokens: step i at ``dyn`` with ``var`` + i, step 0 reading ``first`` (a [1] i32 device
        array), each next step the token of the one before. A [count] i32 device array (valid until the
        chain's next run), or None when the graph cannot be captured (``error`` says why; nothing ran, and
        the caller goes on a step at a time, where the runner falls back to eager launches)."""
        r = self.runner
        maps = [{**dyn, var: dyn[var] + i} for i in range(self.count)]
        r._begin(self.entry, maps[-1])
        if first.dtype != DType.i32 or first.nbytes != 4:
            raise SessionError(f"a step chain starts from one i32 token, got {first.dtype} {first.shape}")
        stage = self._stage[self._turn]
        self._turn ^= 1
        stage.event.synchronize()                 # the copy that last read this staging is done
        words = stage.buf.view(np.int64, self.count * self.dyn_bytes // 8)
        for i, m in enumerate(maps):
            self.plans[i].check(m)
            for order, off in self._orders.items():
                at = (i * self.dyn_bytes + off) // 8
                words[at:at + len(order)] = [int(m.get(v, 0)) for v in order]
        cu.memcpy_htod(self.dyn.ptr, stage.buf.ptr, self.count * self.dyn_bytes, r.stream)
        if first.ptr != self.log.ptr:
            cu.memcpy_dtod(self.log.ptr, first.ptr, 4, r.stream)
        stage.event.record(r.stream)
        try:
            graph = self._graph([p.values(m) for p, m in zip(self.plans, maps)])
        except cu.CudaError as exc:
            self.error = str(exc)
            return None
        graph.launch(r.stream)
        return self._tokens(1, self.count)

    def last_token(self) -> DeviceArray:
        """The last run's last token, as a [1] i32 device array (what a step or the next chain takes)."""
        return self._tokens(self.count, 1)

    def _tokens(self, first: int, n: int) -> DeviceArray:
        r = self.runner
        return DeviceArray(self.log.ptr + 4 * first, (n,), DType.i32, r.device.ordinal, r.stream.ptr, r,
                           r._synchronize, r._to_host)

    def _graph(self, values: list[tuple]) -> cu.Graph:
        """The chain's graph for its steps' :meth:`EntryPlan.values`, captured on first use."""
        parts = [(p, p.segments[0], v) for p, v in zip(self.plans, values)]
        key = tuple(seg.key(v) for _, seg, v in parts)
        g, captured = self.runner._cached_graph(self._graphs, key, parts)
        self.captures += captured
        return g

    def close(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
