"""Choosing a rematerialisation plan by the predicted peak of the whole training step.

The solvers (:mod:`mlcomp.passes.remat.solvers`) bound the saved activations; what
a user measures is the step's peak, which also holds recomputed values, gradients
and backward temporaries at the moment they coexist.  So each plan of the pool
(:func:`mlcomp.passes.remat.pool.pool`) is applied to a copy of the graph and
scored by :func:`mlcomp.analysis.step_peak.step_memory` (the step run in the
rewritten graph's order, the optimizer after it or inside the backward), and
:func:`choose` takes the cheapest plan (recompute cost; ties: the lower peak)
whose predicted peak is at most

    allowed = lowest + budget × (peak without remat − lowest)      (and at most ``peak=``)

where ``lowest`` is the lowest peak of the pool.  Over one pool the plans under
a lower bound are a subset of those under a higher one, so the plan a tighter
budget takes either is the looser budget's plan or has a peak below the tighter
bound, which is below the looser plan's peak: the peak never rises as the
budget falls, and the recompute cost never falls::

    plans (peak, cost): A (100, 0)  B (70, 3)  C (60, 8)        lowest 60, without remat 100
    budget 1.0 -> allowed 100: A      budget 0.25 -> allowed 70: B      budget 0 -> allowed 60: C

A fixed number of plans, each a rewrite and a liveness pass: O(n log n).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mlcomp.analysis.step_peak import StepMemory, step_memory
from mlcomp.ir import Graph
from mlcomp.passes.remat.problem import RematPlan, RematProblem

__all__ = ["Choice", "Scored", "allowed_peak", "choose", "lowest_peak", "score"]


@dataclass(frozen=True)
class Scored:
    """A plan, the graph it rewrites to and that graph's predicted step memory."""

    plan: RematPlan
    graph: Graph
    memory: StepMemory

    @property
    def peak(self) -> int:
        return self.memory.peak_bytes

    def key(self) -> tuple[float, int, int, tuple[int, ...]]:
        """Cheapest first; ties: the lower peak, fewer values recomputed, then the kept set (a total order)."""
        return self.plan.cost, self.peak, len(self.plan.recompute), tuple(sorted(self.plan.keep))


@dataclass(frozen=True)
class Choice:
    """The plan taken (``None``: none is under ``allowed``), the pool's lowest peak and the peak allowed."""

    best: Scored | None
    lowest: Scored
    allowed: int


def score(graph: Graph, problem: RematProblem, plans: Sequence[RematPlan],
          rewrite: Callable[[Graph, RematProblem, RematPlan], int], *,
          workspace: Callable[[Graph], Mapping[str, int]] | None = None, scratch: float = 0.0,
          fused: bool = False) -> list[Scored]:
    """Each plan applied to a copy of ``graph`` and its step's predicted memory."""
    out = []
    for plan in plans:
        after = graph
        if plan.recompute:
            after = graph.copy()
            rewrite(after, problem, plan)
        ws = workspace(after) if workspace is not None else None
        out.append(Scored(plan, after, step_memory(after, workspace=ws, scratch=scratch, fused=fused)))
    return out


def lowest_peak(scored: Sequence[Scored]) -> Scored:
    """The plan of ``scored`` with the lowest predicted peak (ties: the cheapest, by :meth:`Scored.key`)."""
    return min(scored, key=lambda s: (s.peak, *s.key()))


def allowed_peak(lowest: int, unchanged: int, budget: float, limit: int | None = None) -> int:
    """``lowest + budget × (unchanged − lowest)`` (rounded down), at most ``limit``.

    >>> allowed_peak(60, 100, 0.25), allowed_peak(60, 100, 1.0, limit=80), allowed_peak(60, 50, 0.5)
    (70, 80, 60)
    """
    allowed = lowest + int(budget * max(unchanged - lowest, 0))
    return allowed if limit is None else min(allowed, limit)


def choose(scored: Sequence[Scored], unchanged: int, budget: float, limit: int | None = None) -> Choice:
    """The cheapest plan of ``scored`` whose peak is at most :func:`allowed_peak` (``unchanged``: the peak
    without remat)."""
    lowest = lowest_peak(scored)
    allowed = allowed_peak(lowest.peak, unchanged, budget, limit)
    fits = [s for s in scored if s.peak <= allowed]
    return Choice(min(fits, key=Scored.key) if fits else None, lowest, allowed)
