"""Plans aimed at the step's peak: recompute what is held across the peak's moment but read only after it.

The solvers' plans (:mod:`mlcomp.passes.remat.pool`) bound the saved bytes; the
peak of the step is one moment of the backward (:class:`~mlcomp.analysis.step_peak.StepMemory`
names it and what is live there).  A saved activation live at that moment whose
first backward reader runs after it holds memory there for nothing: recomputed,
its copy is placed just before that reader (:func:`mlcomp.passes.remat.remat.rewrite`),
so it leaves the peak's moment.  :func:`aim` starts from a scored plan and
repeats, a fixed number of rounds: evict every such value, score the new plan,
continue from it while the peak falls.  On the zoo transformer (batch 32) the
lowest plan of the pool peaks in the last layer's feed-forward backward with the
residual stream of every earlier layer still held; aimed, those are recomputed
layer by layer::

    lowest plan of the pool:  peak at the last layer's FFN backward, saved activation 32 MiB (8 residual sums)
    aimed:                    the residual sums read after that moment are recomputed at their readers

Each round is a rewrite and a liveness pass: O(n log n).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from mlcomp.analysis.step_peak import StepMemory
from mlcomp.ir.node import Phase
from mlcomp.passes.remat.choose import Scored
from mlcomp.passes.remat.problem import RematPlan, RematProblem

__all__ = ["ROUNDS", "aim", "held_for_later"]

ROUNDS = 6


def held_for_later(memory: StepMemory) -> set[str]:
    """Saved activations live at the peak's moment whose first backward reader runs after it."""
    live, graph, at = memory.live, memory.graph, memory.peak_step
    first: dict[str, int] = {}                      # storage root -> first backward step reading it
    for step, names in enumerate(live.schedule):
        for name in names:
            node = graph.node(name)
            if node.ann.phase is not Phase.BACKWARD:
                continue
            for s in node.input_names():
                first.setdefault(live.storage[s], step)
    return {v.name for v in memory.live_at(at) if v.kind == "saved activation" and first.get(v.name, -1) > at}


def aim(problem: RematProblem, start: Scored, score: Callable[[Sequence[RematPlan]], list[Scored]],
        rounds: int = ROUNDS) -> list[Scored]:
    """Plans derived from ``start`` by evicting :func:`held_for_later` values, each scored; stops when the
    peak stops falling or nothing is left to evict."""
    index = {c.name: i for i, c in enumerate(problem.candidates)}
    out: list[Scored] = []
    current = start
    for _ in range(rounds):
        evict = {index[n] for n in held_for_later(current.memory) if n in index} & current.plan.keep
        evict = {i for i in evict if problem.candidates[i].recomputable}
        if not evict:
            break
        plan = problem.plan(current.plan.keep - evict)
        if plan.keep == current.plan.keep:      # every evicted value is needed to recompute another
            break
        (new,) = score([plan])
        out.append(new)
        if new.peak >= current.peak:
            break
        current = new
    return out
