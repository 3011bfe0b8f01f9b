"""The plans the ``remat`` pass compares: fixed by the graph, the solver and the ``saved`` cap alone.

A solver proposes plans under an allowance of saved bytes
(:func:`mlcomp.passes.remat.solvers.candidates`).  :func:`pool` asks it at each
share of :data:`GRID` of the cap (the saved bytes without remat when there is
no cap) and adds the keep-all plan (when it fits) and the plan keeping the
least (:func:`~mlcomp.passes.remat.solvers.minimum`).  ``budget`` and ``peak``
never change the pool, only which of its plans is taken
(:func:`mlcomp.passes.remat.choose.choose`): so the plan a tighter budget takes
has a predicted peak no higher than a looser one's.  ``sqrt`` is Chen's one
fixed plan.  A fixed number of solver calls: O(n log n) for the fast solvers.

    >>> from mlcomp.passes.remat.problem import Candidate, RematProblem
    >>> chain = RematProblem(tuple(Candidate(f"v{i}", 4096, 1024.0, (i - 1,) if i else (), True, True)
    ...                            for i in range(8)))
    >>> plans = pool(chain, Solver.KNAPSACK, None)        # keep-all, keep none, then the solver's
    >>> len(plans), [p.memory for p in plans[:2]], sorted({p.memory for p in plans[2:]})
    (13, [32768, 0], [4096, 8192, 16384])
"""
from __future__ import annotations

from mlcomp.passes.remat.problem import RematPlan, RematProblem
from mlcomp.passes.remat.solvers import Solver, candidates, minimum, sqrt

__all__ = ["GRID", "pool"]

GRID = (1.0, 0.6, 0.35, 0.25, 0.15, 0.1, 0.06)   # shares of the cap the solver is asked for plans under


def pool(problem: RematProblem, solver: Solver, cap: int | None) -> list[RematPlan]:
    """Distinct plans keeping at most ``cap`` saved bytes (``None``: any), in a fixed order; empty when
    not even :func:`~mlcomp.passes.remat.solvers.minimum` fits."""
    if solver is Solver.SQRT:
        return [sqrt(problem)]
    full, least = problem.keep_all(), minimum(problem)
    top = full.memory if cap is None else min(cap, full.memory)
    if least.memory > top:
        return []
    found = [full, least]
    for share in GRID:
        allowance = int(top * share)
        if allowance >= least.memory:
            found += candidates(problem, solver, allowance)
    plans: dict[frozenset[int], RematPlan] = {}
    for plan in found:
        if plan.memory <= top:
            plans.setdefault(plan.keep, plan)
    return list(plans.values())
