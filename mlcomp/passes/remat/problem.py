"""The rematerialisation problem the solvers work on: candidates, their closure, plans.

A :class:`RematProblem` lists a joint graph's forward values in forward order,
each a :class:`Candidate` with the bytes it holds from the forward into the
backward when kept, the cost of recomputing it once, the values it reads,
whether the backward reads it (``needed``) and whether it may be recomputed::

    x ──▶ a=mm ──▶ b=relu ──▶ c=mm ──▶ d=relu          needed: b, d
    >>> p = RematProblem((Candidate("a", 4096, 65536.0, (), False, True),
    ...                   Candidate("b", 4096, 1024.0, (0,), True, True),
    ...                   Candidate("c", 4096, 65536.0, (1,), False, True),
    ...                   Candidate("d", 4096, 1024.0, (2,), True, True)))
    >>> p.closure(frozenset({3}))    # keep d: b is recomputed, and a with it (b reads a)
    frozenset({0, 1})

A :class:`RematPlan` is what a solver returns (:mod:`mlcomp.passes.remat.solvers`):
the kept set, the recomputed closure, its memory and its cost.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Candidate", "RematPlan", "RematProblem"]


@dataclass(frozen=True)
class Candidate:
    """One forward value (a storage root: views and projections follow it)."""

    name: str
    nbytes: int              # held from the forward into the backward when kept (0: free, e.g. a graph output)
    cost: float              # recomputing it once (FLOPs or seconds)
    inputs: tuple[int, ...]  # candidates it reads (inputs and parameters are free and left out)
    needed: bool             # the backward reads it
    recomputable: bool       # pure and allowed (not random, not mutating, not marked keep)


@dataclass(frozen=True)
class RematProblem:
    candidates: tuple[Candidate, ...]   # forward (topological) order: inputs come first

    def __post_init__(self) -> None:
        for i, c in enumerate(self.candidates):
            if any(j >= i or j < 0 for j in c.inputs):
                raise ValueError(f"candidate {c.name} reads a later candidate; list them in forward order")

    def __len__(self) -> int:
        return len(self.candidates)

    @property
    def needed(self) -> list[int]:
        return list(self._needed)

    def forced(self) -> frozenset[int]:
        """Values every plan keeps: free ones and needed ones that cannot be recomputed."""
        return self._forced

    # found once per problem: the solvers ask for them for every plan they build
    @functools.cached_property
    def _needed(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.candidates) if c.needed)

    @functools.cached_property
    def _forced(self) -> frozenset[int]:
        return frozenset(i for i, c in enumerate(self.candidates) if c.nbytes == 0 or (c.needed and not c.recomputable))

    def keep_all(self) -> RematPlan:
        """No rematerialisation: every needed value is kept."""
        return self.plan(frozenset(self.needed) | self.forced())

    def _walk(self, keep: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
        """(values recomputed, non-recomputable values among them) when ``keep`` is kept."""
        kept, seen = set(keep), set()
        stack = [i for i in self._needed if i not in kept]
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                if self.candidates[i].recomputable:
                    stack.extend(j for j in self.candidates[i].inputs if j not in kept)
        return frozenset(seen), frozenset(i for i in seen if not self.candidates[i].recomputable)

    def closure(self, keep: frozenset[int]) -> frozenset[int] | None:
        """Values recomputed when ``keep`` is kept (``None``: a non-recomputable one would be needed)."""
        recompute, blockers = self._walk(keep)
        return None if blockers else recompute

    def plan(self, keep: Iterable[int]) -> RematPlan:
        """The plan keeping ``keep``, the forced values and every non-recomputable value a
        recomputation would reach (which must then be kept too)."""
        kept = frozenset(keep) | self.forced()
        while True:
            recompute, blockers = self._walk(kept)
            if not blockers:
                return RematPlan(kept, recompute, self.memory(kept), sum(self.candidates[i].cost for i in recompute))
            kept |= blockers

    def memory(self, keep: Iterable[int]) -> int:
        return sum(self.candidates[i].nbytes for i in keep)

    def components(self, members: Iterable[int]) -> list[list[int]]:
        """``members`` grouped by recompute dependencies between them (union-find), each in order."""
        parent = {i: i for i in members}

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in parent:
            for j in self.candidates[i].inputs:
                if j in parent:
                    parent[find(i)] = find(j)
        groups: dict[int, list[int]] = {}
        for i in sorted(parent):
            groups.setdefault(find(i), []).append(i)
        return list(groups.values())

    def segments(self, recompute: Iterable[int]) -> list[int]:
        """Needed bytes of each recompute segment (values joined by recompute dependencies)."""
        return sorted((sum(self.candidates[i].nbytes for i in g if self.candidates[i].needed)
                       for g in self.components(recompute)), reverse=True)


@dataclass(frozen=True)
class RematPlan:
    keep: frozenset[int]
    recompute: frozenset[int]
    memory: int       # bytes kept
    cost: float       # recompute cost
