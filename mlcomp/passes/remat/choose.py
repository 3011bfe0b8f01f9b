"""Choosing a rematerialisation plan by the predicted peak of the whole training step.

The solvers (:mod:`mlcomp.passes.remat.solvers`) bound the saved activations; what
a user measures is the step's peak, which also holds recomputed values, gradients
and backward temporaries at the moment they coexist.  So each candidate plan
(:func:`~mlcomp.passes.remat.solvers.candidates`) is applied to a copy of the
graph and scored by :func:`mlcomp.analysis.step_peak.step_memory` (the step run
in the rewritten graph's order, the optimizer after it or inside the backward):

* with a peak limit (``remat{peak=96MiB}``) the cheapest plan whose predicted
  peak fits wins (ties: the lower peak);
* otherwise the cheapest plan whose predicted peak is within :data:`PEAK_SLACK`
  of the lowest (on ResNet-18 at batch 32 the lowest-peak plan recomputed half
  again as many FLOPs as one 6% above it).

A fixed number of candidates, each a rewrite and a liveness pass: O(n log n).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mlcomp.analysis.step_peak import StepMemory, step_memory
from mlcomp.ir import Graph
from mlcomp.passes.remat.problem import RematPlan, RematProblem

__all__ = ["PEAK_SLACK", "Scored", "choose", "score"]

PEAK_SLACK = 0.1       # plans within 10% of the lowest predicted peak are compared by recompute cost


@dataclass(frozen=True)
class Scored:
    """A plan, the graph it rewrites to and that graph's predicted step memory."""

    plan: RematPlan
    graph: Graph
    memory: StepMemory

    @property
    def peak(self) -> int:
        return self.memory.peak_bytes


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


def choose(scored: Sequence[Scored], peak_limit: int | None = None) -> Scored | None:
    """The plan to apply (see the module docstring); ``None`` when no plan's peak fits ``peak_limit``."""
    if not scored:
        return None
    if peak_limit is not None:
        fits = [s for s in scored if s.peak <= peak_limit]
        return min(fits, key=lambda s: (s.plan.cost, s.peak)) if fits else None
    low = min(s.peak for s in scored)
    near = [s for s in scored if s.peak <= low * (1 + PEAK_SLACK)]
    return min(near, key=lambda s: (s.plan.cost, s.peak))
