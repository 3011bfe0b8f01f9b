"""A run of reshapes and permutes as at most one reshape, one permute and one reshape.

The run is read as moves of "atoms": the input's axes cut where any reshape of the
run cuts them.  The atoms that stay next to each other in the same order from the
input to the output merge, and what is left is a reshape into the atoms, the one
permute that orders them, and a reshape to the output::

    >>> compose((8, 2, 32), [("permute", [1, 0, 2]), ("reshape", [2, 8, 4, 8]),
    ...                      ("permute", [0, 2, 1, 3])])
    [('reshape', [8, 8, 8]), ('permute', [1, 0, 2]), ('reshape', [2, 4, 8, 8])]
    >>> compose((2, 8, 32), [("reshape", [16, 32]), ("reshape", [2, 8, 4, 8])])
    [('reshape', [2, 8, 4, 8])]
    >>> compose((6,), [("reshape", [4, -1])]) is None      # only concrete sizes that divide
    True
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["compose"]

Step = tuple[str, list[int]]


class _Atoms:
    """Atom sizes, and the atoms an atom was cut into."""

    def __init__(self) -> None:
        self.size: list[int] = []
        self.cut: dict[int, tuple[int, int]] = {}

    def new(self, size: int) -> int:
        self.size.append(size)
        return len(self.size) - 1

    def leaves(self, atoms: Sequence[int]) -> list[int]:
        out: list[int] = []
        for a in atoms:
            out += self.leaves(self.cut[a]) if a in self.cut else [a]
        return out


def _regroup(atoms: _Atoms, flat: list[int], shape: Sequence[int]) -> list[list[int]] | None:
    """``flat`` (atoms in order) grouped into dims of ``shape``, cutting atoms where a dim ends inside one."""
    flat, dims = list(flat), []
    for size in shape:
        group, prod = [], 1
        while prod < size and flat:
            a = flat.pop(0)
            if size % (prod * atoms.size[a]) == 0:
                group.append(a)
                prod *= atoms.size[a]
                continue
            need = size // prod
            if size % prod or atoms.size[a] % need:
                return None
            first, rest = atoms.new(need), atoms.new(atoms.size[a] // need)
            atoms.cut[a] = (first, rest)
            group.append(first)
            flat.insert(0, rest)
            prod = size
        if prod != size:
            return None
        dims.append(group)
    return dims if not flat else None


def compose(shape: Sequence[int], steps: Sequence[Step]) -> list[Step] | None:
    """``steps`` (``("reshape", sizes)``, ``("permute", dims)``) on a tensor of ``shape``, as at most a reshape,
    a permute and a reshape (identities left out); None when a size is not a positive concrete number."""
    if any(not isinstance(d, int) or d < 1 for d in shape):
        return None
    atoms = _Atoms()
    source = [[atoms.new(d)] if d > 1 else [] for d in shape]
    dims, out = [list(g) for g in source], list(shape)
    for kind, arg in steps:
        if kind == "permute":
            dims, out = [dims[d % len(dims)] for d in arg], [out[d % len(out)] for d in arg]
            continue
        if any(not isinstance(d, int) or d < 1 for d in arg) or math.prod(arg) != math.prod(out):
            return None
        grouped = _regroup(atoms, [a for g in dims for a in atoms.leaves(g) if atoms.size[a] > 1],
                           [d for d in arg])
        if grouped is None:
            return None
        dims, out = grouped, list(arg)
    return _emit(atoms, atoms.leaves([a for g in source for a in g]),
                 atoms.leaves([a for g in dims for a in g]), list(shape), out)


def _emit(atoms: _Atoms, src: list[int], dst: list[int], shape: list[int], out: list[int]) -> list[Step]:
    """Reshape into merged atoms, permute them into ``dst``'s order, reshape to ``out``."""
    follows = {src[i]: src[i + 1] for i in range(len(src) - 1)}
    runs: list[list[int]] = []
    for a in dst:
        if runs and follows.get(runs[-1][-1]) == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    start = {run[0]: i for i, run in enumerate(runs)}
    order = [start[a] for a in src if a in start]                  # runs in source order
    merged = [math.prod(atoms.size[a] for a in runs[i]) for i in order]
    perm = [order.index(i) for i in range(len(runs))]
    result: list[Step] = []
    if perm != sorted(perm):
        if merged != shape:
            result.append(("reshape", merged))
        result.append(("permute", perm))
        permuted = [merged[p] for p in perm]
    else:
        permuted = shape
    if permuted != out:
        result.append(("reshape", out))
    return result
