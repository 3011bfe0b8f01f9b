"""Rematerialisation solvers: which forward values to keep for the backward, which to recompute.

Every solver is a pure function over a small typed problem, not over the IR
(:mod:`mlcomp.passes.remat.remat` builds the problem from a joint graph and rewrites
the graph from the plan).  A :class:`RematProblem` lists the forward values in
forward order; each has the bytes it holds from the forward into the backward
when kept, the cost of recomputing it once, the values it reads, whether the
backward reads it (``needed``) and whether it may be recomputed at all::

    x ──▶ a=mm ──▶ b=relu ──▶ c=mm ──▶ d=relu          needed: b, d (read by the backward)
    >>> from mlcomp.passes.remat.problem import Candidate
    >>> p = RematProblem((Candidate("a", 4096, 65536.0, (), False, True),
    ...                   Candidate("b", 4096, 1024.0, (0,), True, True),
    ...                   Candidate("c", 4096, 65536.0, (1,), False, True),
    ...                   Candidate("d", 4096, 1024.0, (2,), True, True)))
    >>> plan = knapsack(p, allowance=4096)     # before: keep {b, d}; after: keep {d}, recompute {a, b}
    >>> plan.keep, plan.recompute, plan.cost
    (frozenset({3}), frozenset({0, 1}), 66560.0)

A plan keeps a set ``K``; every needed value outside ``K`` is recomputed in the
backward together with the inputs it needs that are not kept (the closure
``R``, each value recomputed once and shared).  The model every solver is judged
by: memory = bytes of ``K`` (the saved activations the backward still reads);
cost = summed cost of ``R``; a plan is feasible when ``R`` holds only
recomputable values.  Every budget solver returns a plan whose memory is within
the allowance whenever one exists (:func:`minimum` is the least memory any plan
reaches).

* :func:`sqrt` -- Chen et al. 2016: cut the needed values (forward order) into
  √n segments and keep the segment boundaries; ignores the allowance.
* :func:`mincut` -- like torch's ``min_cut_rematerialization_partition``: a
  minimum s-t cut (networkx) where keeping a value costs its bytes and
  recomputing it costs ``λ·cost``; ``λ`` is bisected to meet the allowance.
* :func:`knapsack` -- greedy: evict the needed values with the most bytes per
  unit of added recompute cost (lazy heap, costs only grow) while recompute
  segments stay under a cap; the cheapest plan over a few caps wins, and among
  equally cheap ones the one with the smallest recompute segment.
* :func:`milp` -- the exact optimum of the model by ``scipy.optimize.milp``
  (HiGHS); for small graphs and as the reference the tests compare with.

All but ``milp`` run in O(n log n) for bounded recompute chains (``mincut``: the
max-flow of networkx, bisected a fixed number of times).
"""
from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Iterable

from mlcomp.passes.remat.problem import RematPlan, RematProblem

__all__ = ["SOLVERS", "Solver", "candidates", "estimate", "knapsack", "milp",
           "mincut", "minimum", "pick", "solve", "sqrt", "use_slack"]


class Solver(enum.Enum):
    SQRT = "sqrt"
    MINCUT = "mincut"
    KNAPSACK = "knapsack"
    MILP = "milp"


# ---------------------------------------------------------------------------
# sqrt (Chen et al. 2016)


def sqrt(problem: RematProblem, allowance: int | None = None) -> RematPlan:
    """Keep every ⌈√n⌉-th of the n evictable needed values (forward order); recompute the rest."""
    forced = problem.forced()
    movable = [i for i in problem.needed if i not in forced]
    if not movable:
        return problem.keep_all()
    step = max(1, math.ceil(math.sqrt(len(movable))))
    keep = {i for k, i in enumerate(movable) if k % step == step - 1}
    return problem.plan(keep)


# ---------------------------------------------------------------------------
# min cut (torch's partitioner, with a price on recomputation)


def _cut(problem: RematProblem, lam: float) -> frozenset[int]:
    import networkx as nx  # the flow network of the problem (not the IR)

    net = nx.DiGraph()
    net.add_nodes_from(("source", "sink"))
    for i, c in enumerate(problem.candidates):
        a, b = ("in", i), ("out", i)
        net.add_edge(a, b, capacity=float(c.nbytes))                # cut here: keep i
        if c.recomputable:
            net.add_edge("source", a, capacity=lam * max(c.cost, 0.0))   # a on the sink side: recompute i
        else:
            net.add_edge("source", a)                                # banned: infinite
        for j in c.inputs:
            net.add_edge(("out", j), a)                              # infinite: a value needs its inputs
        if c.needed:
            net.add_edge(b, "sink")
    _, (side, _) = nx.minimum_cut(net, "source", "sink")
    return frozenset(i for i in range(len(problem)) if ("in", i) in side and ("out", i) not in side)


def estimate(problem: RematProblem, plan: RematPlan) -> int:
    """Kept bytes plus the largest recompute segment (materialised at once in the backward): a proxy
    for the backward's peak; :func:`pick` prefers plans where it stays within the keep-all memory."""
    return plan.memory + max(problem.segments(plan.recompute), default=0)


def minimum(problem: RematProblem) -> RematPlan:
    """The plan keeping the fewest bytes: a min cut where recomputing is free and values that cannot
    be recomputed (random ops, inputs, graph outputs) are kept or cut around.  No plan keeps less."""
    return problem.plan(_cut(problem, 0.0))


def use_slack(problem: RematProblem, plan: RematPlan, allowance: int) -> RematPlan:
    """Spend bytes left under ``allowance`` on splitting recompute segments: keep the middle needed value
    of the largest one while that fits and lowers :func:`estimate` (keeping more never costs more)."""
    cands = problem.candidates
    while True:
        groups = [[i for i in g if cands[i].needed and cands[i].nbytes > 0]
                  for g in problem.components(plan.recompute)]
        groups = [g for g in groups if len(g) > 1]
        if not groups:
            return plan
        big = max(groups, key=lambda g: sum(cands[i].nbytes for i in g))
        half, acc, pick = sum(cands[i].nbytes for i in big) / 2, 0, big[-1]
        for i in big:
            acc += cands[i].nbytes
            if acc >= half:
                pick = i
                break
        split = problem.plan(plan.keep | {pick})
        if split.memory > allowance or estimate(problem, split) >= estimate(problem, plan):
            return plan
        plan = split


def mincut(problem: RematProblem, allowance: int, *, rounds: int = 16) -> RematPlan:
    """The cheapest min-cut plan keeping at most ``allowance`` bytes, over ``λ`` (bisected in log space),
    its spare bytes spent on splitting long recompute segments (:func:`use_slack`).  When nothing fits,
    the plan keeping the least (:func:`minimum`)."""
    full = problem.keep_all()
    if full.memory <= allowance:
        return full
    tried = _bisect(problem, allowance, rounds)
    best = pick(problem, tried, allowance)
    return tried[0] if best is None else use_slack(problem, best, allowance)


def _bisect(problem: RematProblem, allowance: int, rounds: int = 16) -> list[RematPlan]:
    """The least-memory plan, then the min-cut plan at each ``λ`` of a bisection towards ``allowance``."""
    total = sum(c.cost for c in problem.candidates) or 1.0
    bytes_total = sum(c.nbytes for c in problem.candidates) or 1
    lo, hi = math.log(1e-6 / total), math.log(1e6 * bytes_total)   # λ at lo: recompute all; at hi: keep all
    tried = [minimum(problem)]
    for _ in range(rounds):
        mid = (lo + hi) / 2
        tried.append(problem.plan(_cut(problem, math.exp(mid))))
        if tried[-1].memory <= allowance:
            lo = mid
        else:
            hi = mid
    return tried


def pick(problem: RematProblem, plans: Iterable[RematPlan], allowance: int) -> RematPlan | None:
    """The cheapest plan keeping at most ``allowance`` bytes, first among those whose :func:`estimate` stays
    within the keep-all memory (their backward holds no more at once than without remat); ties: the smaller
    estimate.  ``None`` when none fits."""
    top = problem.keep_all().memory
    fits = [(estimate(problem, p), p) for p in plans if p.memory <= allowance]
    if not fits:
        return None
    return min(fits, key=lambda ep: (ep[0] > top, ep[1].cost, ep[0], ep[1].memory))[1]


# ---------------------------------------------------------------------------
# knapsack (greedy bytes per recompute cost, lazy heap)


def _greedy(problem: RematProblem, allowance: int, cap: float, max_chain: int) -> RematPlan:
    cands = problem.candidates
    keep = set(problem.needed) | set(problem.forced())
    recompute: set[int] = set()
    memory = problem.memory(keep)
    seg_of: dict[int, int] = {}     # recomputed value -> segment id (union-find root)
    seg_bytes: dict[int, int] = {}

    def find(i: int) -> int:
        while seg_of[i] != i:
            seg_of[i] = seg_of[seg_of[i]]
            i = seg_of[i]
        return i

    def added(v: int) -> tuple[float, list[int], list[int]] | None:
        """Cost, new members and newly kept values (inputs that cannot be recomputed) of recomputing ``v``
        given the current plan (None: the segment would grow past ``max_chain``)."""
        new, extra, stack = [], [], [v]
        seen = {v}
        while stack:
            i = stack.pop()
            if not cands[i].recomputable:
                extra.append(i)
                continue
            if len(new) >= max_chain:
                return None
            new.append(i)
            for j in cands[i].inputs:
                if j not in seen and j not in recompute and (j not in keep or j == v):
                    seen.add(j)
                    stack.append(j)
        return sum(cands[i].cost for i in new), new, extra

    users: dict[int, list[int]] = {}
    for i, c in enumerate(cands):
        for j in c.inputs:
            users.setdefault(j, []).append(i)
    forced = problem.forced()
    heap = [(-c.nbytes / max(c.cost, 1e-12), i) for i, c in enumerate(cands)
            if c.needed and i not in forced and c.nbytes > 0]
    heapq.heapify(heap)
    top = max(cap, float(sum(cands[i].nbytes for i in problem.needed)))
    skipped: list[tuple[float, int]] = []
    while memory > allowance:
        if not heap:                 # stalled under the cap: let segments grow to twice the size
            if not skipped or cap >= top:
                break
            cap, heap, skipped = min(2 * cap, top), skipped, []
            heapq.heapify(heap)
        ratio, v = heapq.heappop(heap)
        got = added(v)
        if got is None:
            continue
        cost, new, extra = got
        gain = cands[v].nbytes - sum(cands[i].nbytes for i in extra)
        if gain <= 0:
            continue
        fresh = -gain / max(cost, 1e-12)
        if fresh > ratio + 1e-12 * abs(ratio):          # costs only grow: re-queue with the true ratio
            heapq.heappush(heap, (fresh, v))
            continue
        # the segment this eviction forms: the new members plus the segments they touch
        roots = {find(j) for i in new for j in (*cands[i].inputs, *users.get(i, ())) if j in recompute}
        size = sum(seg_bytes[r] for r in roots) + sum(cands[i].nbytes for i in new if cands[i].needed)
        if size > cap:
            skipped.append((ratio, v))
            continue
        keep.discard(v)
        keep.update(extra)
        memory -= gain
        for i in new:
            recompute.add(i)
            seg_of[i] = v
        for r in roots:
            seg_of[r] = v
        seg_bytes[v] = size
    return problem.plan(keep)


def knapsack(problem: RematProblem, allowance: int, *, max_chain: int = 64) -> RematPlan:
    """Greedy by bytes saved per recompute cost, over a few caps on a recompute segment's bytes.

    A recompute segment is materialised at once in the backward, so smaller caps
    give plans that hold less at once; the cheapest plan keeping at most
    ``allowance`` bytes wins (ties: the smaller :func:`estimate`), its spare bytes
    spent on splitting segments.  When no greedy plan fits, :func:`mincut`'s.
    """
    full = problem.keep_all()
    if full.memory <= allowance:
        return full
    movable = sum(problem.candidates[i].nbytes for i in problem.needed if i not in problem.forced())
    best = pick(problem, [_greedy(problem, allowance, max(movable / (1 << k), 1.0), max_chain) for k in range(8)],
                allowance)
    return mincut(problem, allowance) if best is None else use_slack(problem, best, allowance)


# ---------------------------------------------------------------------------
# MILP (exact reference)


def milp(problem: RematProblem, allowance: int) -> RematPlan:
    """Minimum recompute cost with kept bytes ≤ ``allowance`` (HiGHS); the keep-all plan if it fits.

    Variables ``k_i`` (kept) and ``r_i`` (recomputed); a needed value is kept or
    recomputed, a recomputed value's inputs are kept or recomputed.  Raises
    ``ValueError`` when no plan fits (the forced values alone exceed the allowance).
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.optimize import milp as highs

    n = len(problem)
    forced = problem.forced()
    cands = problem.candidates
    cost = np.array([c.cost for c in cands] + [0.0] * n)   # x = [r_0..r_n-1, k_0..k_n-1]
    cost[n:] = [1e-9 * c.nbytes for c in cands]          # ties: the plan that keeps less
    rows, lo = [], []
    for i, c in enumerate(cands):
        if c.needed:
            row = np.zeros(2 * n)
            row[i] = row[n + i] = 1.0                       # r_i + k_i >= 1
            rows.append(row)
            lo.append(1.0)
        for j in c.inputs:
            row = np.zeros(2 * n)
            row[j] = row[n + j] = 1.0
            row[i] = -1.0                                   # r_j + k_j - r_i >= 0
            rows.append(row)
            lo.append(0.0)
    mem = np.zeros(2 * n)
    mem[n:] = [c.nbytes for c in cands]
    rows.append(mem)
    constraints = [LinearConstraint(np.array(rows[:-1]), lo, np.inf)] if len(rows) > 1 else []
    constraints.append(LinearConstraint(mem[None, :], -np.inf, float(allowance)))
    upper = np.array([1.0 if c.recomputable else 0.0 for c in cands] + [1.0] * n)
    lower = np.array([0.0] * n + [1.0 if i in forced else 0.0 for i in range(n)])
    res = highs(cost, constraints=constraints, integrality=np.ones(2 * n), bounds=Bounds(lower, upper))
    if res.x is None:
        raise ValueError(f"no plan keeps at most {allowance} bytes (the values that must be kept hold "
                         f"{problem.memory(forced)})")
    keep = {i for i in range(n) if res.x[n + i] > 0.5}
    return problem.plan(keep)


SOLVERS: dict[Solver, Callable[[RematProblem, int], RematPlan]] = {
    Solver.SQRT: sqrt, Solver.MINCUT: mincut, Solver.KNAPSACK: knapsack, Solver.MILP: milp}


def solve(problem: RematProblem, solver: Solver, allowance: int) -> RematPlan:
    return SOLVERS[solver](problem, allowance)


def candidates(problem: RematProblem, solver: Solver, allowance: int) -> list[RematPlan]:
    """Distinct plans keeping at most ``allowance`` bytes, for a choice by the step's peak: the solver's plan
    (``mincut``: every plan of its bisection over ``λ`` that fits, and each with its slack spent; ``knapsack``:
    the greedy plan of every segment cap -- smaller caps: smaller recompute segments, lower peaks, more
    recompute).  ``sqrt`` and ``milp`` give their one plan; the keep-all plan alone when it fits."""
    full = problem.keep_all()
    if full.memory <= allowance:
        return [full]
    if solver in (Solver.SQRT, Solver.MILP):
        return [solve(problem, solver, allowance)]
    movable = sum(problem.candidates[i].nbytes for i in problem.needed if i not in problem.forced())
    plans: dict[frozenset[int], RematPlan] = {}
    if solver is Solver.MINCUT:
        tried = [p for p in _bisect(problem, allowance) if p.memory <= allowance]
        found = tried + [use_slack(problem, p, allowance) for p in tried]
    else:
        found = [use_slack(problem, _greedy(problem, allowance, max(movable / (1 << k), 1.0), 64), allowance)
                 for k in range(8)]
    for plan in found:
        if plan.memory <= allowance:
            plans.setdefault(plan.keep, plan)
    return list(plans.values()) or [solve(problem, solver, allowance)]
