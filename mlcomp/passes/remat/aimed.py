"""Plans aimed at the step's peak: recompute what is held across the peak's moment but read only after it.

The solvers' plans (:mod:`mlcomp.passes.remat.pool`) bound the saved bytes; the
peak of the step is one moment of the backward (:class:`~mlcomp.analysis.step_peak.StepMemory`
names it and what is live there).  A saved activation live at that moment whose
first backward reader runs after it holds memory there for nothing: recomputed,
its copy is placed just before that reader (:func:`mlcomp.passes.remat.remat.rewrite`),
so it leaves the peak's moment -- though its recomputation may raise another
moment.  :func:`aim` is a local search from a scored plan: each round scores the
plan evicting each of the few largest such values, and continues from the
lowest while the peak falls.  On the zoo transformer after ``cleanup`` (batch
32, fused update) the pool's lowest plan peaks at 100.0 MiB in the last layer's
feed-forward backward, holding that layer's attention probabilities (12 MiB)
for its attention backward; aimed::

    pool's lowest   100.0 MiB   at %relu_3.remat    saved activation 44 MiB
    evict clone_16   92.0 MiB   at %relu_2.remat    (attention probabilities recomputed at their reader)
    evict clone      88.0 MiB                       (the input's copy)

A fixed number of rounds and tries, each a rewrite and a liveness pass: O(n log n).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from mlcomp.analysis.step_peak import StepMemory
from mlcomp.ir.node import Phase
from mlcomp.passes.remat.choose import Scored, lowest_peak
from mlcomp.passes.remat.problem import RematPlan, RematProblem

__all__ = ["ROUNDS", "TRIES", "aim", "held_for_later"]

ROUNDS = 6       # rounds of eviction from one start
TRIES = 4        # values tried per round, largest first


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
        rounds: int = ROUNDS, tries: int = TRIES) -> list[Scored]:
    """Plans derived from ``start``, each scored: per round, the plan evicting one of the ``tries`` largest
    :func:`held_for_later` values, for each of them; the round's lowest peak is the next start while the
    peak falls."""
    index = {c.name: i for i, c in enumerate(problem.candidates)}
    cands = problem.candidates
    out: list[Scored] = []
    current = start
    for _ in range(rounds):
        held = sorted((index[n] for n in held_for_later(current.memory) if n in index),
                      key=lambda i: (-cands[i].nbytes, i))
        held = [i for i in held if i in current.plan.keep and cands[i].recomputable][:tries]
        plans = {p.keep: p for p in (problem.plan(current.plan.keep - {i}) for i in held)}
        plans.pop(current.plan.keep, None)          # a value another recomputation needs stays kept
        if not plans:
            break
        scored = score(list(plans.values()))
        out += scored
        best = lowest_peak(scored)
        if best.peak >= current.peak:
            break
        current = best
    return out
