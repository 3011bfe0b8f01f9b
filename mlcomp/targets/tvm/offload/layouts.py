"""Static strided layouts: what a chain of reshape/permute/select ops does to a tensor's memory.

A :class:`Layout` says, for every logical axis of a value, which elements of a contiguous *source*
tensor it walks: each axis is a row-major list of modes ``(size, stride)`` and the whole has one
element offset.  The layout ops of Relax (reshape, permute_dims, expand_dims, squeeze, take of
one index, broadcast_to) map layouts to layouts without touching data, so a chain of them from a
source to a value is either one strided view of the source (every axis one mode: a
``torch.as_strided`` away; a piece of a ``split`` is a narrowed axis), or a permutation of the source's factors followed by a reshape
(:meth:`Layout.gather`: what ``reshape(F).permute(P).reshape(S)`` copies).  Nothing here imports
TVM or torch; :mod:`mlcomp.targets.tvm.offload.views` reads the chains off Relax and writes the specs.

    before:  y = permute_dims(reshape(x[32, 4, 128, 64] ... ))   # as Relax ops, each a TVM copy loop
             Layout.contiguous((128, 32, 768)).reshape((128, 32, 3, 256)).select(2, 0)
                   .reshape((128, 128, 64)).permute((1, 0, 2)).reshape((32, 4, 128, 64))
    after:   dims ((768,), (64,), (24576,), (1,)) strides, sizes (32, 4, 128, 64), offset 0:
             q = source.as_strided((32, 4, 128, 64), (768, 64, 24576, 1), 0)   # a view, no copy

A reshape that merges axes whose modes do not line up keeps both modes in one axis (no longer one
stride); :meth:`Layout.strided` then says None and :meth:`Layout.gather` still describes the copy.
Every method is O(rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

__all__ = ["Layout", "LayoutError", "Mode"]

Mode = tuple[int, int]   # (size, stride) in elements of the source


class LayoutError(ValueError):
    """The op cannot be expressed on this layout (a reshape that splits a mode unevenly, a bad axis)."""


def _coalesce(modes: tuple[Mode, ...]) -> tuple[Mode, ...]:
    """Drop size-1 modes; merge neighbours ``(m1, t1), (m2, t2)`` with ``t1 == m2 * t2``."""
    out: list[Mode] = []
    for size, stride in modes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def _axes(axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    norm = tuple(a + rank if a < 0 else a for a in axes)
    if any(not 0 <= a < rank for a in norm):
        raise LayoutError(f"axes {axes} out of range for rank {rank}")
    return norm


@dataclass(frozen=True)
class Layout:
    """Per logical axis its modes (row-major), plus the offset of element 0 in the source."""

    dims: tuple[tuple[Mode, ...], ...]
    offset: int = 0

    @classmethod
    def contiguous(cls, shape: tuple[int, ...]) -> Layout:
        strides = [prod(shape[i + 1:]) for i in range(len(shape))]
        return cls(tuple(_coalesce(((s, t),)) for s, t in zip(shape, strides)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(prod(m for m, _ in d) for d in self.dims)

    def permute(self, axes: tuple[int, ...] | None) -> Layout:
        axes = tuple(reversed(range(len(self.dims)))) if axes is None else _axes(axes, len(self.dims))
        if sorted(axes) != list(range(len(self.dims))):
            raise LayoutError(f"{axes} is not a permutation of rank {len(self.dims)}")
        return Layout(tuple(self.dims[a] for a in axes), self.offset)

    def reshape(self, shape: tuple[int, ...]) -> Layout:
        """Row-major reshape: the flat mode list regrouped into ``shape`` (a mode split where a new axis ends)."""
        if prod(shape) != prod(self.shape):
            raise LayoutError(f"cannot reshape {self.shape} to {shape}")
        modes = [m for d in self.dims for m in d]
        dims: list[tuple[Mode, ...]] = []
        for size in shape:
            need, got = size, []
            while need > 1:
                m, t = modes.pop(0)
                if need % m == 0:
                    got.append((m, t))
                    need //= m
                elif m % need == 0:   # the outer part of this mode ends the axis, the inner part stays
                    got.append((need, t * (m // need)))
                    modes.insert(0, (m // need, t))
                    need = 1
                else:
                    raise LayoutError(f"reshape {self.shape} -> {shape} splits a mode of size {m} by {need}")
            dims.append(_coalesce(tuple(got)))
        return Layout(tuple(dims), self.offset)

    def expand_dims(self, axes: tuple[int, ...]) -> Layout:
        rank = len(self.dims) + len(axes)
        new = set(_axes(axes, rank))
        rest = iter(self.dims)
        return Layout(tuple(() if i in new else next(rest) for i in range(rank)), self.offset)

    def squeeze(self, axes: tuple[int, ...] | None) -> Layout:
        shape = self.shape
        drop = {i for i, s in enumerate(shape) if s == 1} if axes is None else set(_axes(axes, len(shape)))
        if any(shape[a] != 1 for a in drop):
            raise LayoutError(f"squeeze of a non-unit axis of {shape}")
        return Layout(tuple(d for i, d in enumerate(self.dims) if i not in drop), self.offset)

    def select(self, axis: int, index: int) -> Layout:
        """Element ``index`` of ``axis`` (the axis goes away; ``take`` of a scalar index)."""
        (axis,) = _axes((axis,), len(self.dims))
        size = self.shape[axis]
        if not -size <= index < size:
            raise LayoutError(f"index {index} out of range for axis of size {size}")
        index %= size
        offset = self.offset
        for m, t in reversed(self.dims[axis]):   # the index in mixed radix over the axis's modes
            offset += (index % m) * t
            index //= m
        return Layout(self.dims[:axis] + self.dims[axis + 1:], offset)

    def narrow(self, axis: int, start: int, length: int) -> Layout:
        """Elements ``start … start + length - 1`` of ``axis`` (a piece of ``split``); the axis must be one mode."""
        (axis,) = _axes((axis,), len(self.dims))
        size, modes = self.shape[axis], self.dims[axis]
        if len(modes) > 1 or not (0 <= start and start + length <= size):
            raise LayoutError(f"cannot narrow axis {axis} of {self.shape} to [{start}, {start + length})")
        stride = modes[0][1] if modes else 0
        dims = self.dims[:axis] + (_coalesce(((length, stride),)),) + self.dims[axis + 1:]
        return Layout(dims, self.offset + start * stride)

    def broadcast(self, shape: tuple[int, ...]) -> Layout:
        """``broadcast_to``: new leading axes and size-1 axes repeat with stride 0."""
        extra = len(shape) - len(self.dims)
        if extra < 0:
            raise LayoutError(f"cannot broadcast {self.shape} to {shape}")
        dims = [((s, 0),) if s != 1 else () for s in shape[:extra]]
        for d, s, old in zip(self.dims, shape[extra:], self.shape):
            if old == s:
                dims.append(d)
            elif old == 1:
                dims.append(((s, 0),))
            else:
                raise LayoutError(f"cannot broadcast {self.shape} to {shape}")
        return Layout(tuple(dims), self.offset)

    @property
    def is_contiguous(self) -> bool:
        """Whether this is the source itself, in order (a reshape at most: nothing to copy)."""
        return self == Layout.contiguous(self.shape)

    def rows(self, width: int) -> Layout | None:
        """The layout of the rows alone when this only rearranges whole rows of ``width`` elements."""
        if not self.dims or self.dims[-1] != ((width, 1),) or self.offset % width:
            return None
        if any(t % width for d in self.dims[:-1] for _, t in d):
            return None
        return Layout(tuple(tuple((m, t // width) for m, t in d) for d in self.dims[:-1]), self.offset // width)

    def widen(self, width: int) -> Layout:
        """The inverse of :meth:`rows`: these rows (over a source of rows) as rows of ``width`` elements each
        (what a linear of ``width`` outputs does to a rearrangement of its input's rows)."""
        dims = tuple(_coalesce(tuple((m, t * width) for m, t in d)) for d in self.dims)
        return Layout((*dims, _coalesce(((width, 1),))), self.offset * width)

    def strided(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(sizes, strides)`` of the one strided view this layout is, or None (an axis of two modes)."""
        if any(len(d) > 1 for d in self.dims):
            return None
        return self.shape, tuple(d[0][1] if d else 0 for d in self.dims)

    def gather(self, size: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """``(F, P, S)`` with ``value == source.reshape(F).permute(P).reshape(S)``, or None.

        Holds for a pure rearrangement of the whole source of ``size`` elements (no select, narrow or
        broadcast): its modes, sorted by stride, are a row-major factorisation ``F`` of the source.
        """
        modes = [m for d in self.dims for m in d]
        order = sorted(range(len(modes)), key=lambda i: -modes[i][1])
        factors = tuple(modes[i][0] for i in order)
        expect = 1
        for i in reversed(order):   # strides must be exactly the row-major strides of F
            if modes[i][1] != expect:
                return None
            expect *= modes[i][0]
        if self.offset != 0 or expect != size:
            return None
        where = {i: k for k, i in enumerate(order)}
        return factors, tuple(where[i] for i in range(len(modes))), self.shape
