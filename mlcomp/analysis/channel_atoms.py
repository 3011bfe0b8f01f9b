"""Atoms: the union-find under channel groups, over index spaces that reshapes may split.

An axis of a value is a list of atoms (major first).  ``unify`` makes two axis
layouts of the same total size the same index space, splitting atoms where one
side is finer::

    before                                  after unify([a768], [b3, c256])
    a: 768 (one atom)                       a = b3 × c256   (a is split; b, c unchanged)
    fixed flags, roles on a                 copied to both parts

A fixed atom (an input, an output, an index…) stays fixed through every union and
split.  ``find`` compresses paths, so a walk over n nodes costs O(n α(n)).
"""
from __future__ import annotations

import enum
import math
from typing import Iterable

__all__ = ["Atoms", "Role"]


class Role(enum.Enum):
    """What an op does with an atom; decides a group's kind."""

    CONV_OUT = "conv"          # output channels of a convolution weight
    LINEAR_OUT = "linear"      # output features of a matmul weight
    HEAD = "head"              # a batch axis of bmm (attention heads)
    BMM_INNER = "bmm"          # contracted or kept axis of an activation-activation bmm



class Atoms:
    """Union-find over atoms; an atom may be split into a product of sub-atoms (major first)."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.fixed: list[str | None] = []
        self.split: dict[int, list[int]] = {}
        self.up: list[int | None] = []      # the atom this one was split from
        self.roles: dict[int, set[Role]] = {}

    def new(self, size: int, fixed: str | None = None, up: int | None = None) -> int:
        self.parent.append(len(self.parent))
        self.size.append(int(size))
        self.fixed.append(fixed)
        self.up.append(up)
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def leaves(self, atoms: Iterable[int]) -> list[int]:
        """Roots of the atoms with splits expanded, size-1 atoms dropped."""
        out: list[int] = []
        stack = [self.find(a) for a in reversed(list(atoms))]
        while stack:
            a = self.find(stack.pop())
            if a in self.split:
                stack.extend(reversed(self.split[a]))
            elif self.size[a] != 1:
                out.append(a)
        return out

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        if a > b:
            a, b = b, a
        self.parent[b] = a
        self.fixed[a] = self.fixed[a] or self.fixed[b]
        self.roles.setdefault(a, set()).update(self.roles.pop(b, set()))

    def fix(self, atoms: Iterable[int], why: str) -> None:
        for a in self.leaves(atoms):
            self.fixed[a] = self.fixed[a] or why

    def mark(self, atoms: Iterable[int], role: Role) -> None:
        for a in self.leaves(atoms):
            self.roles.setdefault(a, set()).add(role)

    def _cut(self, a: int, first: int) -> tuple[int, int]:
        """Split leaf ``a`` into ``first`` × rest."""
        x = self.new(first, self.fixed[a], a)
        y = self.new(self.size[a] // first, self.fixed[a], a)
        self.split[a] = [x, y]
        for part in (x, y):
            self.roles[part] = set(self.roles.get(a, ()))
        return x, y

    def unify(self, left: list[int], right: list[int]) -> None:
        """Make two axis layouts of the same total size the same index space, splitting as needed."""
        a, b = self.leaves(left), self.leaves(right)
        if math.prod(self.size[x] for x in a) != math.prod(self.size[x] for x in b):
            self.fix(left + right, "sizes do not line up")
            return
        i = j = 0
        while i < len(a) and j < len(b):
            x, y = self.find(a[i]), self.find(b[j])
            sx, sy = self.size[x], self.size[y]
            if sx == sy:
                self.union(x, y)
                i, j = i + 1, j + 1
            elif sx > sy and sx % sy == 0:
                a[i:i + 1] = list(self._cut(x, sy))
            elif sy > sx and sy % sx == 0:
                b[j:j + 1] = list(self._cut(y, sx))
            else:
                self.fix(a[i:] + b[j:], "a reshape mixes channels")
                return

    def fixed_reason(self, a: int) -> str | None:
        """Why the atom is fixed (a split copies the flag to its parts, ``fix`` reaches every part)."""
        return self.fixed[self.find(a)]
