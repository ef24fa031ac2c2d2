"""ShapeTracker: how a logical tensor index maps onto a producer's contiguous buffer.

One strided view with symbolic dims, strides and offset, plus a per-dim validity box for padding:
element ``i`` is ``buf[offset + Σ i_k·stride_k]`` when ``mask_lo_k ≤ i_k < mask_hi_k`` for every k,
else 0. View ops (``permute``, ``expand``, ``reshape``, ``slice``, ``pad``) return a new tracker and
never touch data; a reshape that no single strided view can express returns ``None`` and the frontend
materialises the tensor with a Contiguous node first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from lum.format.expr import Expr, ExprLike, Var, as_expr, lt, smax, smin

Shape = tuple[Expr, ...]


def _exprs(xs: Sequence[ExprLike]) -> Shape:
    return tuple(as_expr(x) for x in xs)


def contiguous_strides(shape: Sequence[ExprLike]) -> Shape:
    strides: list[Expr] = []
    acc = as_expr(1)
    for d in reversed(_exprs(shape)):
        strides.append(acc)
        acc = acc * d
    return tuple(reversed(strides))


def numel(shape: Sequence[ExprLike]) -> Expr:
    out = as_expr(1)
    for d in shape:
        out = out * d
    return out


@dataclass(frozen=True)
class ShapeTracker:
    shape: Shape
    strides: Shape
    offset: Expr
    mask: tuple[tuple[Expr, Expr], ...] | None = None  # per-dim valid [lo, hi); None = all valid

    # ------------------------------------------------------------------ construction
    @staticmethod
    def contiguous(shape: Sequence[ExprLike]) -> ShapeTracker:
        sh = _exprs(shape)
        return ShapeTracker(sh, contiguous_strides(sh), as_expr(0), None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        return self.mask is None and self.offset == as_expr(0) and self.strides == contiguous_strides(self.shape)

    def _mask(self) -> tuple[tuple[Expr, Expr], ...]:
        if self.mask is not None:
            return self.mask
        return tuple((as_expr(0), d) for d in self.shape)

    def _norm_axis(self, axis: int) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise IndexError(f"axis {axis} out of range for {self.ndim} dims")
        return axis % self.ndim

    # ------------------------------------------------------------------ view ops
    def permute(self, order: Sequence[int]) -> ShapeTracker:
        order = [self._norm_axis(o) for o in order]
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute order {order} is not a permutation of {self.ndim} dims")
        mask = None if self.mask is None else tuple(self.mask[o] for o in order)
        return ShapeTracker(tuple(self.shape[o] for o in order), tuple(self.strides[o] for o in order),
                            self.offset, mask)

    def expand_dim(self, axis: int, size: ExprLike) -> ShapeTracker:
        """Insert a broadcast dim (stride 0) of ``size`` at ``axis``."""
        if axis < 0:
            axis += self.ndim + 1
        if not 0 <= axis <= self.ndim:
            raise IndexError(f"expand axis {axis} out of range")
        size = as_expr(size)
        mask = None
        if self.mask is not None:
            mask = self.mask[:axis] + ((as_expr(0), size),) + self.mask[axis:]
        return ShapeTracker(self.shape[:axis] + (size,) + self.shape[axis:],
                            self.strides[:axis] + (as_expr(0),) + self.strides[axis:], self.offset, mask)

    def broadcast_to(self, shape: Sequence[ExprLike]) -> ShapeTracker:
        """numpy-style broadcast of size-1 dims (and new leading dims) to ``shape``."""
        target = _exprs(shape)
        if len(target) < self.ndim:
            raise ValueError(f"cannot broadcast shape {_fmt(self.shape)} to fewer dims {_fmt(target)}")
        st = self
        while st.ndim < len(target):
            st = st.expand_dim(0, 1)
        dims, strides = list(st.shape), list(st.strides)
        mask = list(st._mask()) if st.mask is not None else None
        for i, (have, want) in enumerate(zip(st.shape, target)):
            if have == want:
                continue
            if have != as_expr(1):
                raise ValueError(f"cannot broadcast shape {_fmt(st.shape)} to {_fmt(target)}")
            dims[i], strides[i] = want, as_expr(0)
            if mask is not None:
                # The unit dim is valid iff lo <= 0 < hi, i.e. lo == 0 and hi >= 1 (lo >= 0 always).
                # Broadcast keeps that all-or-nothing: [0, want) when valid, an empty range otherwise.
                lo, hi = mask[i]
                mask[i] = (smin(lo, 1) * want, smax(smin(hi, 1), 0) * want)
        return ShapeTracker(tuple(dims), tuple(strides), st.offset, None if mask is None else tuple(mask))

    def slice(self, axis: int, start: ExprLike, stop: ExprLike) -> ShapeTracker:
        """Keep ``[start, stop)`` of ``axis``."""
        axis = self._norm_axis(axis)
        start, stop = as_expr(start), as_expr(stop)
        dims, strides = list(self.shape), list(self.strides)
        dims[axis] = stop - start
        offset = self.offset + start * self.strides[axis]
        mask = None
        if self.mask is not None:
            mask = list(self.mask)
            lo, hi = mask[axis]
            mask[axis] = (smax(lo - start, 0), smin(hi - start, dims[axis]))
            mask = tuple(mask)
        return ShapeTracker(tuple(dims), tuple(strides), offset, mask)

    def pad(self, axis: int, before: ExprLike, after: ExprLike) -> ShapeTracker:
        """Add ``before``/``after`` zero elements around ``axis`` (none: the view itself, unmasked, so a
        reshape after it stays a view)."""
        axis = self._norm_axis(axis)
        before, after = as_expr(before), as_expr(after)
        if before == as_expr(0) and after == as_expr(0):
            return self
        mask = list(self._mask())
        lo, hi = mask[axis]
        mask[axis] = (lo + before, hi + before)
        dims = list(self.shape)
        dims[axis] = dims[axis] + before + after
        offset = self.offset - before * self.strides[axis]
        return ShapeTracker(tuple(dims), self.strides, offset, tuple(mask))

    def reshape(self, shape: Sequence[ExprLike]) -> ShapeTracker | None:
        """The same elements under a new shape, or None when no single strided view expresses it."""
        new = _exprs(shape)
        if numel(new) != numel(self.shape):
            raise ValueError(f"cannot reshape {_fmt(self.shape)} to {_fmt(new)}: element counts differ")
        if new == self.shape:
            return self
        if self.mask is not None:
            # A padded view can only be reshaped by adding/removing unit dims.
            return self._reshape_unit_dims(new)
        if self.is_contiguous:
            return ShapeTracker.contiguous(new)
        # Drop unit dims, then cut old and new dims into groups at the points where their prefix
        # products agree. Products are canonical expressions, so a symbolic boundary such as
        # (s+1)*(s+1) == s*s + 2*s + 1 is found as well as a constant one; a boundary that only holds
        # for some values of a dyn var is never used (the result must be right for all of them).
        one = as_expr(1)
        old = [(d, s) for d, s in zip(self.shape, self.strides) if d != one]
        new_nz = [i for i, d in enumerate(new) if d != one]
        new_prefix: dict[Expr, int] = {}
        acc = one
        for k, i in enumerate(new_nz):
            acc = acc * new[i]
            new_prefix.setdefault(acc, k + 1)
        cuts = [(0, 0)]
        acc = one
        for k, (d, _) in enumerate(old):
            acc = acc * d
            j = new_prefix.get(acc)
            if j is not None and j > cuts[-1][1]:
                cuts.append((k + 1, j))
        if cuts[-1] != (len(old), len(new_nz)):
            return None
        new_strides: list[Expr] = [as_expr(0)] * len(new)
        for (o0, n0), (o1, n1) in zip(cuts, cuts[1:]):
            o_group = old[o0:o1]
            # the old group must be mergeable: stride_k == stride_{k+1} * dim_{k+1}
            for (_, s0), (d1, s1) in zip(o_group, o_group[1:]):
                if s0 != s1 * d1:
                    return None
            inner = o_group[-1][1]
            for idx in reversed(new_nz[n0:n1]):
                new_strides[idx] = inner
                inner = inner * new[idx]
        return ShapeTracker(new, tuple(new_strides), self.offset, None)

    def _reshape_unit_dims(self, new: Shape) -> ShapeTracker | None:
        kept = [(d, s, m) for d, s, m in zip(self.shape, self.strides, self.mask) if d != as_expr(1)]
        # unit dims that are masked out entirely (hi <= lo) cannot be dropped safely
        for d, s, m in zip(self.shape, self.strides, self.mask):
            if d == as_expr(1) and not (m[0] == as_expr(0) and m[1] == as_expr(1)):
                return None
        if [d for d, _, _ in kept] != [d for d in new if d != as_expr(1)]:
            return None
        dims, strides, mask = [], [], []
        it = iter(kept)
        for d in new:
            if d == as_expr(1):
                dims.append(d)
                strides.append(as_expr(0))
                mask.append((as_expr(0), as_expr(1)))
            else:
                kd, ks, km = next(it)
                dims.append(kd)
                strides.append(ks)
                mask.append(km)
        return ShapeTracker(tuple(dims), tuple(strides), self.offset, tuple(mask))

    # ------------------------------------------------------------------ indexing
    def index_vars(self, prefix: str = "i") -> tuple[Expr, ...]:
        return tuple(Var(f"{prefix}{k}") for k in range(self.ndim))

    def physical_index(self, idx: Sequence[ExprLike] | None = None) -> Expr:
        """Buffer element index for logical index ``idx`` (default: variables i0, i1, …)."""
        idx = self.index_vars() if idx is None else _exprs(idx)
        out = self.offset
        for i, s in zip(idx, self.strides):
            out = out + i * s
        return out

    def validity(self, idx: Sequence[ExprLike] | None = None) -> Expr:
        """1 where the logical index reads real data, 0 where it reads padding."""
        idx = self.index_vars() if idx is None else _exprs(idx)
        if self.mask is None:
            return as_expr(1)
        out = as_expr(1)
        for i, (lo, hi), d in zip(idx, self.mask, self.shape):
            if lo != as_expr(0):
                out = out * (1 - lt(i, lo))
            if hi != d:
                out = out * lt(i, hi)
        return out

    def evaluate(self, dyn_map: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...], int,
                                                           tuple[tuple[int, int], ...] | None]:
        """Concrete (shape, strides, offset, mask) for a dyn_map."""
        shape = tuple(d.evaluate(dyn_map) for d in self.shape)
        strides = tuple(s.evaluate(dyn_map) for s in self.strides)
        off = self.offset.evaluate(dyn_map)
        mask = None
        if self.mask is not None:
            mask = tuple((max(0, lo.evaluate(dyn_map)), min(d, hi.evaluate(dyn_map)))
                         for (lo, hi), d in zip(self.mask, shape))
        return shape, strides, off, mask

    def substitute(self, mapping: Mapping[str, ExprLike]) -> ShapeTracker:
        sub = lambda xs: tuple(x.substitute(mapping) for x in xs)  # noqa: E731
        mask = None if self.mask is None else tuple((lo.substitute(mapping), hi.substitute(mapping))
                                                    for lo, hi in self.mask)
        return ShapeTracker(sub(self.shape), sub(self.strides), self.offset.substitute(mapping), mask)

    def key(self) -> str:
        """Stable text used by structural hashing."""
        m = "-" if self.mask is None else ";".join(f"{lo}:{hi}" for lo, hi in self.mask)
        return f"[{_fmt(self.shape)}|{_fmt(self.strides)}|{self.offset}|{m}]"


def _fmt(xs: Sequence[Expr]) -> str:
    return ",".join(str(x) for x in xs)
