"""Atoms: the union-find under channel groups, over index spaces that reshapes may split.

An axis of a value is a list of atoms (major first).  ``unify`` makes two axis
layouts of the same total size the same index space, splitting atoms where one
side is finer::

    before                                  after unify([a768], [b3, c256])
    a: 768 (one atom)                       a = b3 × c256   (a is split; b, c unchanged)
    fixed flags, roles on a                 copied to both parts

An atom may also be a *concatenation* of atoms (``cat``: a concat's output axis, or
the input of a split or slice, which is a concat read backwards)::

    o = cat([p64, q64, r64])     o: 192 = p ++ q ++ r; a channel c of q is channel 64 + c of o

A concat atom is never split into a product (that would mix its parts: it is fixed
instead); unifying two concats of the same part sizes unifies the parts, other
boundaries fix both.  A fixed concat fixes its parts and passes on its roles (:meth:`finalize`).

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
        self.concat: dict[int, list[int]] = {}  # root -> its parts, in order (sizes add up)

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

    def cat(self, parts: list[int]) -> int:
        """An atom that is ``parts`` one after the other (size-0 parts dropped; one part is itself)."""
        parts = [p for p in parts if self.size[p] != 0]
        if len(parts) == 1:
            return parts[0]
        root = self.new(sum(self.size[p] for p in parts))
        self.concat[root] = parts
        return root

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        if a > b:
            a, b = b, a
        self.parent[b] = a
        self.fixed[a] = self.fixed[a] or self.fixed[b]
        self.roles.setdefault(a, set()).update(self.roles.pop(b, set()))
        ca, cb = self.concat.pop(a, None), self.concat.pop(b, None)
        if ca is not None or cb is not None:
            self.concat[a] = ca if ca is not None else cb           # type: ignore[assignment]
        if ca is not None and cb is not None:
            if [self.size[p] for p in ca] == [self.size[p] for p in cb]:
                for x, y in zip(ca, cb):
                    self.unify([x], [y])
            else:
                self.fix([a] + cb, "split and concatenated at different offsets")

    def fix(self, atoms: Iterable[int], why: str) -> None:
        todo = self.leaves(atoms)
        while todo:                       # a stack, not recursion: concats may nest thousands deep
            a = todo.pop()
            self.fixed[a] = self.fixed[a] or why
            if a in self.concat:
                todo.extend(self.leaves(self.concat[a]))

    def finalize(self) -> None:
        """Carry fixed flags and roles from every concat to its parts (set by unions after the concat).

        A part reached twice gets nothing new the second time: O(atoms) in all.
        """
        todo = list(self.concat)
        while todo:
            r = self.find(todo.pop())
            why, roles = self.fixed[r], self.roles.get(r, set())
            for a in self.leaves(self.concat.get(r, ())):
                new_flag = why is not None and self.fixed[a] is None
                new_roles = not roles <= self.roles.get(a, set())
                if new_flag:
                    self.fixed[a] = why
                if new_roles:
                    self.roles.setdefault(a, set()).update(roles)
                if (new_flag or new_roles) and a in self.concat:
                    todo.append(a)

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
            elif sx > sy and sx % sy == 0 and x not in self.concat:
                a[i:i + 1] = list(self._cut(x, sy))
            elif sy > sx and sy % sx == 0 and y not in self.concat:
                b[j:j + 1] = list(self._cut(y, sx))
            else:
                self.fix(a[i:] + b[j:], "a reshape mixes channels")
                return

    def fixed_reason(self, a: int) -> str | None:
        """Why the atom is fixed (a split copies the flag to its parts, ``fix`` reaches every part)."""
        return self.fixed[self.find(a)]
