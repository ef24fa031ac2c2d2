"""ShapeTracker against numpy: random view-op sequences, every logical index checked.

The model keeps, next to the tracker, the numpy value of the logical tensor (``val``) and a boolean
array saying which elements come from the buffer (``valid``; False = padding). The buffer holds
distinct non-zero values (``arange + 1``), so a wrong physical index or a missing mask shows up as a
wrong value. When ``reshape`` returns None the test does what the frontend does: materialise the
current logical tensor into a fresh contiguous buffer and continue from ``ShapeTracker.contiguous``.
"""

from __future__ import annotations

import os
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lum.format.expr import Const, Var, as_expr
from lum.format.shapetracker import ShapeTracker

SCALE = float(os.environ.get("LUM_HYPOTHESIS_SCALE", "1"))
MAX_NUMEL = 1500  # keep the per-index loop cheap: size-increasing ops are skipped past this
s = Var("s")


def _settings(n: int):
    return settings(max_examples=int(n * SCALE), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Model:
    """Tracker + numpy reference of the logical tensor it describes."""

    def __init__(self, shape, env=None):
        """``shape`` may hold symbolic dims; ``env`` gives their values for the numpy side."""
        self.env = dict(env or {})
        conc = tuple(int(as_expr(d).evaluate(self.env)) for d in shape)
        self.buf = np.arange(prod(conc), dtype=np.int64) + 1
        self.val = self.buf.reshape(conc).copy()
        self.valid = np.ones(conc, dtype=bool)
        self.st = ShapeTracker.contiguous(shape)
        self.materialised = 0

    @property
    def shape(self):
        return self.val.shape

    def sym_shape(self):
        return self.st.shape

    # ---- ops: each applies the same change to the tracker and to the numpy model
    def permute(self, order):
        self.st = self.st.permute(order)
        self.val = np.transpose(self.val, order)
        self.valid = np.transpose(self.valid, order)

    def expand_dim(self, axis, size):
        self.st = self.st.expand_dim(axis, size)
        n = int(as_expr(size).evaluate(self.env))
        new_shape = list(self.shape)
        new_shape.insert(axis if axis >= 0 else axis + self.val.ndim + 1, n)
        self.val = np.broadcast_to(np.expand_dims(self.val, axis), new_shape)
        self.valid = np.broadcast_to(np.expand_dims(self.valid, axis), new_shape)

    def broadcast_to(self, shape):
        self.st = self.st.broadcast_to(shape)
        conc = tuple(int(as_expr(d).evaluate(self.env)) for d in shape)
        self.val = np.broadcast_to(self.val, conc)
        self.valid = np.broadcast_to(self.valid, conc)

    def reshape(self, shape):
        conc = tuple(int(as_expr(d).evaluate(self.env)) for d in shape)
        must_view = _must_be_view(self.st, shape)
        new = self.st.reshape(shape)
        assert new is not None or not must_view, (self.st.key(), conc)
        event("reshape: copy" if new is None else "reshape: view" if new.mask is None else "reshape: masked view")
        if new is None:  # the frontend inserts a Contiguous node: materialise the logical tensor
            self.buf = np.ascontiguousarray(self.val).reshape(-1).copy()
            self.valid = np.ones(self.shape, dtype=bool)
            new = ShapeTracker.contiguous(shape)
            self.materialised += 1
        self.st = new
        self.val = self.val.reshape(conc)
        self.valid = self.valid.reshape(conc)

    def slice(self, axis, start, stop):
        self.st = self.st.slice(axis, start, stop)
        a, b = (int(as_expr(x).evaluate(self.env)) for x in (start, stop))
        sl = [slice(None)] * self.val.ndim
        sl[axis] = slice(a, b)
        self.val = self.val[tuple(sl)]
        self.valid = self.valid[tuple(sl)]

    def pad(self, axis, before, after):
        self.st = self.st.pad(axis, before, after)
        a, b = (int(as_expr(x).evaluate(self.env)) for x in (before, after))
        width = [(0, 0)] * self.val.ndim
        width[axis] = (a, b)
        self.val = np.pad(self.val, width, constant_values=0)
        self.valid = np.pad(self.valid, width, constant_values=False)

    # ---- the check
    def check(self):
        st_, env, val, valid, buf = self.st, self.env, self.val, self.valid, self.buf
        assert val.shape == tuple(d.evaluate(env) for d in st_.shape)
        # padded positions are exactly the zeros of the model until a materialisation copies zeros in
        if not self.materialised:
            assert np.array_equal(valid, val != 0)
        assert not val[~valid].any()
        phys, vmask = st_.physical_index(), st_.validity()
        idx_vars = [f"i{k}" for k in range(val.ndim)]
        for idx in np.ndindex(val.shape):
            e = dict(env)
            e.update(zip(idx_vars, idx))
            ok = vmask.evaluate(e)
            assert ok in (0, 1)
            assert ok == int(valid[idx]), (idx, str(vmask), st_.key())
            if ok:
                p = phys.evaluate(e)
                assert 0 <= p < buf.size, (idx, p, st_.key())
                assert buf[p] == val[idx], (idx, p, st_.key())
        # concrete index arguments give the same answers (corners + a few interior points)
        pts = {tuple(0 for _ in val.shape), tuple(d - 1 for d in val.shape),
               tuple(d // 2 for d in val.shape)}
        for idx in pts:
            ok = st_.validity(idx).evaluate(env)
            assert ok == int(valid[idx])
            if ok:
                assert buf[st_.physical_index(idx).evaluate(env)] == val[idx]
        # evaluate(): the concrete (shape, strides, offset, mask) describe the same view
        shape, strides, off, mask = st_.evaluate(env)
        assert shape == val.shape
        grids = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), dtype=np.int64)
        pidx = off + sum((g * sd for g, sd in zip(grids, strides)), np.zeros(shape, dtype=np.int64))
        vm = np.ones(shape, dtype=bool)
        if mask is not None:
            for g, (lo, hi) in zip(grids, mask):
                vm &= (g >= lo) & (g < hi)
        assert np.array_equal(vm, valid)
        if vm.any():
            assert pidx[vm].min() >= 0 and pidx[vm].max() < buf.size
            assert np.array_equal(buf[pidx[vm]], val[vm])
        # the text key and substitute() do not crash and keep the tracker
        assert isinstance(st_.key(), str)
        assert st_.substitute({}) == st_


def _must_be_view(st_, shape):
    """Reshapes that a single strided view always expresses (judged symbolically, so it also holds
    for every value of a symbolic dim): adding/removing unit dims (with valid unit dims when masked),
    and, without a mask, splitting one dim or merging two adjacent dims whose strides allow it."""
    one = as_expr(1)
    old, strides, mask = st_.shape, st_.strides, st_.mask
    new = tuple(as_expr(d) for d in shape)
    if [d for d in old if d != one] == [d for d in new if d != one]:  # only unit dims added/removed
        return mask is None or all(lo.is_const and hi.is_const and lo.value <= 0 < hi.value
                                   for d, (lo, hi) in zip(old, mask) if d == one)
    if mask is not None:
        return False
    if len(new) == len(old) + 1:  # one dim split in two
        return any(new[:k] == old[:k] and new[k] * new[k + 1] == old[k] and new[k + 2:] == old[k + 1:]
                   for k in range(len(old)))
    if len(new) == len(old) - 1:  # two adjacent dims merged, when their strides allow it
        return any(new[:k] == old[:k] and new[k] == old[k] * old[k + 1] and new[k + 1:] == old[k + 2:]
                   and (strides[k] == strides[k + 1] * old[k + 1] or one in (old[k], old[k + 1]))
                   for k in range(len(old) - 1))
    return False


# --------------------------------------------------------------------------- random op sequences
def _factorizations(n: int, ndim: int, draw):
    """A random ordered factorisation of n into ndim factors (unit factors allowed)."""
    primes, m, f = [], n, 2
    while m > 1:
        while m % f == 0:
            primes.append(f)
            m //= f
        f += 1
    dims = [1] * ndim
    for pr in primes:
        dims[draw(st.integers(0, ndim - 1))] *= pr
    return dims


def draw_op(draw, m: Model):
    shape = m.shape
    nd = len(shape)
    numel = prod(shape)
    ops = ["permute", "reshape", "reshape_merge", "reshape_unit"]
    if nd:  # a 0-d tensor (reshape to ()) has no axis to slice, pad or split
        ops += ["slice", "slice_one", "reshape_split"]
    if numel * 3 <= MAX_NUMEL and nd < 6:
        ops += ["expand_dim", "broadcast_to", "broadcast_to"]
    if numel * 5 <= MAX_NUMEL and nd:
        ops += ["pad", "pad"]
    kind = draw(st.sampled_from(ops))
    if kind == "permute":
        return ("permute", tuple(draw(st.permutations(range(nd)))))
    if kind == "expand_dim":
        return ("expand_dim", draw(st.integers(-nd - 1, nd)), draw(st.integers(1, 3)))
    if kind == "broadcast_to":
        lead = draw(st.lists(st.integers(1, 3), max_size=max(0, min(1, 5 - nd))))
        target = [draw(st.integers(1, 3)) if d == 1 else d for d in shape]
        return ("broadcast_to", tuple(lead) + tuple(target))
    if kind == "slice":
        ax = draw(st.integers(0, nd - 1))
        start = draw(st.integers(0, shape[ax] - 1))
        stop = draw(st.integers(start + 1, shape[ax]))
        return ("slice", ax, start, stop)
    if kind == "slice_one":  # a unit dim cut out of (possibly padded) data, ready to be broadcast
        ax = draw(st.integers(0, nd - 1))
        start = draw(st.integers(0, shape[ax] - 1))
        return ("slice", ax, start, start + 1)
    if kind == "pad":
        return ("pad", draw(st.integers(0, nd - 1)), draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    if kind == "reshape_merge" and nd >= 2:
        ax = draw(st.integers(0, nd - 2))
        return ("reshape", shape[:ax] + (shape[ax] * shape[ax + 1],) + shape[ax + 2:])
    if kind == "reshape_split":
        ax = draw(st.integers(0, nd - 1))
        divs = [d for d in range(1, shape[ax] + 1) if shape[ax] % d == 0]
        d = draw(st.sampled_from(divs))
        return ("reshape", shape[:ax] + (d, shape[ax] // d) + shape[ax + 1:])
    if kind == "reshape_unit":
        dims = [d for d in shape if d != 1]
        for _ in range(draw(st.integers(0, 2))):
            dims.insert(draw(st.integers(0, len(dims))), 1)
        return ("reshape", tuple(dims))
    new_nd = draw(st.integers(1, 4))
    return ("reshape", tuple(_factorizations(numel, new_nd, draw)))


def apply(m: Model, op):
    getattr(m, op[0])(*op[1:])


@_settings(250)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple), st.data())
def test_random_view_ops_match_numpy(shape, data):
    m = Model(shape)
    m.check()
    for _ in range(data.draw(st.integers(1, 6), label="n_ops")):
        op = draw_op(data.draw, m)
        data.draw(st.just(op), label="op")
        apply(m, op)
        m.check()


@_settings(100)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), st.data())
def test_padding_then_unit_slice_then_broadcast(shape, data):
    """Directed sequence: pad an axis, cut a unit slice (data or padding) from it, broadcast it, go on."""
    m = Model(shape)
    ax = data.draw(st.integers(0, len(shape) - 1), label="axis")
    m.pad(ax, data.draw(st.integers(0, 2), label="before"), data.draw(st.integers(0, 2), label="after"))
    start = data.draw(st.integers(0, m.shape[ax] - 1), label="start")
    m.slice(ax, start, start + 1)
    m.check()
    target = tuple(data.draw(st.integers(1, 3), label="size") if d == 1 else d for d in m.shape)
    m.broadcast_to(target)
    m.check()
    for _ in range(data.draw(st.integers(0, 3), label="n_ops")):
        op = draw_op(data.draw, m)
        data.draw(st.just(op), label="op")
        apply(m, op)
        m.check()


# --------------------------------------------------------------------------- symbolic dims
def _sym_options(n: int):
    """Sizes usable in ops, symbolic or not (all >= 1 for s = n >= 1)."""
    return [Const(1), Const(2), s, s + 1]


def draw_sym_op(draw, m: Model, n: int):
    shape = m.sym_shape()
    conc = m.shape
    nd = len(shape)
    numel = prod(conc)
    ops = ["permute", "reshape_merge", "reshape_unit"]
    if nd:  # a 0-d tensor has no axis to slice, pad or split
        ops += ["slice", "reshape_split"]
    if numel * (n + 2) <= MAX_NUMEL and nd < 6:
        ops += ["expand_dim", "broadcast_to"]
    if numel * (n + 2) <= MAX_NUMEL and nd:
        ops += ["pad"]
    kind = draw(st.sampled_from(ops))
    if kind == "permute":
        return ("permute", tuple(draw(st.permutations(range(nd)))))
    if kind == "expand_dim":
        return ("expand_dim", draw(st.integers(-nd - 1, nd)), draw(st.sampled_from(_sym_options(n))))
    if kind == "broadcast_to":
        target = tuple(draw(st.sampled_from(_sym_options(n))) if d == as_expr(1) else d for d in shape)
        lead = tuple(draw(st.lists(st.sampled_from(_sym_options(n)), max_size=1)))
        return ("broadcast_to", lead + target)
    if kind == "slice":
        ax = draw(st.integers(0, nd - 1))
        d = shape[ax]
        # symbolic bounds: from {0, 1, d-1, d//2} to {1, d, d-1, d//2+1}; keep those valid at s = n
        starts = [x for x in (Const(0), Const(1), d - 1, d // 2) if 0 <= x.evaluate({"s": n}) < conc[ax]]
        start = draw(st.sampled_from(starts))
        stops = [x for x in (Const(1), d, d - 1, d // 2 + 1, start + 1)
                 if start.evaluate({"s": n}) < x.evaluate({"s": n}) <= conc[ax]]
        return ("slice", ax, start, draw(st.sampled_from(stops)))
    if kind == "pad":
        opts = [Const(0), Const(1), s]
        return ("pad", draw(st.integers(0, nd - 1)), draw(st.sampled_from(opts)), draw(st.sampled_from(opts)))
    if kind == "reshape_merge" and nd >= 2:
        ax = draw(st.integers(0, nd - 2))
        return ("reshape", shape[:ax] + (shape[ax] * shape[ax + 1],) + shape[ax + 2:])
    if kind == "reshape_split":
        cands = [k for k, d in enumerate(shape) if d.is_const and d.value % 2 == 0]
        cands += [k for k, d in enumerate(shape) if not d.is_const and _const_factor(d) > 1]
        if cands:
            ax = draw(st.sampled_from(cands))
            d = shape[ax]
            f = d.value // 2 if d.is_const else _const_factor(d)
            return ("reshape", shape[:ax] + (d // f, Const(f)) + shape[ax + 1:])
    dims = [d for d in shape if d != as_expr(1)]
    for _ in range(draw(st.integers(0, 2))):
        dims.insert(draw(st.integers(0, len(dims))), Const(1))
    return ("reshape", tuple(dims))


def _const_factor(d) -> int:
    for f in (4, 3, 2):
        if (d // f) * f == d:
            return f
    return 1


@_settings(120)
@given(st.integers(1, 4), st.data())
def test_symbolic_view_ops_match_numpy(n, data):
    """A tracker over a dim `s`, evaluated at s = n, matches numpy built with the concrete sizes."""
    dims = data.draw(st.lists(st.sampled_from([Const(1), Const(2), Const(3), Const(4), s, 2 * s]),
                              min_size=1, max_size=3), label="dims")
    if not any(not d.is_const for d in dims):
        dims.append(s)
    m = Model(tuple(dims), env={"s": n})
    m.check()
    for _ in range(data.draw(st.integers(1, 6), label="n_ops")):
        op = draw_sym_op(data.draw, m, n)
        data.draw(st.just(tuple(str(x) if not isinstance(x, (int, tuple)) else x for x in op)), label="op")
        apply(m, op)
        m.check()
        # substituting s and simplifying gives a tracker with the same concrete meaning
        conc = m.st.substitute({"s": n})
        assert conc.evaluate({}) == m.st.evaluate({"s": n})


# --------------------------------------------------------------------------- reshape: view or None
def _same_elements(st_a, st_b, env=None):
    """Both trackers read the same buffer elements in the same (row-major) order."""
    env = env or {}
    sa = tuple(d.evaluate(env) for d in st_a.shape)
    sb = tuple(d.evaluate(env) for d in st_b.shape)
    assert prod(sa) == prod(sb)
    ia = [st_a.physical_index(i).evaluate(env) for i in np.ndindex(sa)]
    ib = [st_b.physical_index(i).evaluate(env) for i in np.ndindex(sb)]
    va = [st_a.validity(i).evaluate(env) for i in np.ndindex(sa)]
    vb = [st_b.validity(i).evaluate(env) for i in np.ndindex(sb)]
    assert va == vb
    assert [x for x, v in zip(ia, va) if v] == [x for x, v in zip(ib, vb) if v]


@pytest.mark.parametrize("base,shape", [
    # contiguous: any reshape
    (lambda: ShapeTracker.contiguous((2, 3, 4)), (6, 4)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)), (24,)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)), (4, 3, 2)),
    # permuted (4,2,3) with strides (1,12,4): merge the contiguous pair, split the permuted dim
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)), (4, 6)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)), (2, 2, 2, 3)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)), (4, 2, 3, 1)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)), (1, 4, 1, 2, 3)),
    # removing the unit dims again
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)).reshape((1, 4, 1, 2, 3)), (4, 2, 3)),
    # transposed matrix: adding/removing unit dims and splitting dims are views
    (lambda: ShapeTracker.contiguous((3, 4)).permute((1, 0)), (4, 1, 3)),
    (lambda: ShapeTracker.contiguous((3, 4)).permute((1, 0)), (2, 2, 3)),
    # sliced (offset, non-contiguous) view: merge of the rows that are still contiguous
    (lambda: ShapeTracker.contiguous((4, 3, 5)).slice(0, 1, 3), (6, 5)),
    # broadcast dims merge with each other
    (lambda: ShapeTracker.contiguous((3,)).expand_dim(0, 2).expand_dim(0, 2), (4, 3)),
    # padded view: adding/removing unit dims keeps the mask
    (lambda: ShapeTracker.contiguous((3, 4)).pad(1, 1, 1), (3, 1, 6)),
    (lambda: ShapeTracker.contiguous((3, 4)).pad(1, 1, 1).reshape((1, 3, 6)), (3, 6)),
    # symbolic dims
    (lambda: ShapeTracker.contiguous((s, 4)).permute((1, 0)), (4, s, 1)),
    (lambda: ShapeTracker.contiguous((s, 8)).slice(1, 0, 4), (s, 2, 2)),
    (lambda: ShapeTracker.contiguous((3, s, 4)).slice(0, 1, 3), (2, 4 * s)),
    (lambda: ShapeTracker.contiguous((3, s, 4)).slice(0, 1, 3), (2 * s, 4)),
    (lambda: ShapeTracker.contiguous((3, s, 4)).slice(0, 1, 3), (2, s, 2, 2)),
])
def test_reshape_is_a_view(base, shape):
    st_ = base()
    new = st_.reshape(shape)
    assert new is not None
    assert new.shape == tuple(as_expr(d) for d in shape)
    env = {"s": 3}
    _same_elements(st_, new, env)


@pytest.mark.parametrize("base,shape", [
    (lambda: ShapeTracker.contiguous((3, 4)).permute((1, 0)), (12,)),
    (lambda: ShapeTracker.contiguous((3, 4)).permute((1, 0)), (2, 6)),
    (lambda: ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)), (8, 3)),
    (lambda: ShapeTracker.contiguous((4, 3, 5)).slice(2, 0, 2), (2, 12)),
    (lambda: ShapeTracker.contiguous((3,)).expand_dim(1, 2), (6,)),
    (lambda: ShapeTracker.contiguous((3, 4)).pad(1, 1, 1), (18,)),
    (lambda: ShapeTracker.contiguous((s, 4)).permute((1, 0)), (4 * s,)),
])
def test_reshape_needs_a_copy(base, shape):
    assert base().reshape(shape) is None


def test_reshape_rejects_wrong_numel():
    with pytest.raises(ValueError):
        ShapeTracker.contiguous((2, 3)).reshape((5,))


def test_contiguous_and_key():
    c = ShapeTracker.contiguous((2, s, 4))
    assert c.is_contiguous
    assert c.strides == (4 * s, Const(4), Const(1))
    assert c.reshape((2 * s, 4)).is_contiguous
    assert not c.permute((1, 0, 2)).is_contiguous
    assert not c.pad(0, 1, 0).is_contiguous
    assert not c.slice(0, 1, 2).is_contiguous
    assert c.key() != c.permute((1, 0, 2)).key()
    assert c.key() == ShapeTracker.contiguous((2, s, 4)).key()
    assert c.substitute({"s": 3}) == ShapeTracker.contiguous((2, 3, 4))


def test_padding_by_nothing_is_the_view_itself():
    v = ShapeTracker(tuple(as_expr(d) for d in (4, 6)), tuple(as_expr(d) for d in (6, 1)), as_expr(0), None)
    assert v.pad(1, 0, 0) is v and v.pad(0, 0, 0).mask is None
    assert v.pad(1, 0, 0).reshape((as_expr(24),)) == ShapeTracker.contiguous((as_expr(24),))
    assert v.pad(1, 0, 1).mask is not None


def test_broadcast_of_padding_stays_padding():
    # a unit dim that is entirely padding must stay padding when broadcast
    t = ShapeTracker.contiguous((3, 1)).pad(1, 1, 0).slice(1, 0, 1)  # (3, 1), all padding
    b = t.broadcast_to((3, 4))
    for i in range(3):
        for j in range(4):
            assert b.validity((i, j)).evaluate({}) == 0
    t2 = ShapeTracker.contiguous((3, 1)).pad(1, 1, 0).slice(1, 1, 2)  # (3, 1), all data
    b2 = t2.broadcast_to((2, 3, 4))
    assert all(b2.validity((k, i, j)).evaluate({}) == 1 for k in range(2) for i in range(3) for j in range(4))
    assert b2.physical_index((1, 2, 3)).evaluate({}) == 2


def test_broadcast_errors():
    with pytest.raises(ValueError):
        ShapeTracker.contiguous((2, 3)).broadcast_to((4, 3))
    with pytest.raises(ValueError):
        ShapeTracker.contiguous((2, 3)).broadcast_to((3,))


def test_index_vars_default():
    t = ShapeTracker.contiguous((2, 3)).permute((1, 0))
    assert t.physical_index() == Var("i0") + 3 * Var("i1")
    assert t.validity() == Const(1)
    padded = ShapeTracker.contiguous((3,)).pad(0, 1, 2)
    assert padded.validity((0,)).evaluate({}) == 0
    assert padded.validity((1,)).evaluate({}) == 1
    assert padded.validity((4,)).evaluate({}) == 0
    assert padded.physical_index((1,)).evaluate({}) == 0
