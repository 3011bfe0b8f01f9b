"""Rematerialisation solvers on small typed problems (no IR): exactness, factors, Chen's √n.

``milp`` must equal brute force on every tiny problem and ``minimum`` must find
the least memory any plan keeps; ``knapsack`` and ``mincut`` must keep at most
the allowance (kept bytes: the budget's meaning) whenever that is feasible, and
stay within a stated factor of ``milp``'s recompute cost for the bytes they
keep, on the small zoo graphs (mlp, lenet at batch 4).  Observed factor: 1.0
for both solvers on both graphs at allowances of 90/75/50 % of the keep-all
memory; the test allows 1.25.
"""
from __future__ import annotations

import random

import pytest
import torch

from mlcomp.passes.remat.problem import Candidate, RematProblem
from mlcomp.passes.remat.solvers import (
    Solver,
    estimate,
    knapsack,
    milp,
    mincut,
    minimum,
    solve,
    sqrt,
)

FACTOR = 1.25    # knapsack and mincut cost / milp cost on the small zoo graphs (observed: 1.0)


def chain(n: int, *, nbytes: int = 100, cost: float = 1.0) -> RematProblem:
    """x -> v0 -> v1 -> ... ; every value needed by the backward."""
    return RematProblem(tuple(Candidate(f"v{i}", nbytes, cost, (i - 1,) if i else (), True, True)
                              for i in range(n)))


def brute_force(problem: RematProblem, allowance: int):
    """The cheapest plan over every keep set of the non-forced values (at most ~12 of them)."""
    forced = problem.forced()
    free = [i for i in range(len(problem)) if i not in forced]
    best = None
    for mask in range(1 << len(free)):
        keep = forced | {free[b] for b in range(len(free)) if mask >> b & 1}
        if problem.memory(keep) > allowance or problem.closure(keep) is None:
            continue
        plan = problem.plan(keep)
        if best is None or (plan.cost, plan.memory) < (best.cost, best.memory):
            best = plan
    if best is None:
        raise ValueError(f"no plan keeps at most {allowance} bytes")
    return best


def random_problem(seed: int, n: int) -> RematProblem:
    rng = random.Random(seed)
    cands = []
    for i in range(n):
        reads = tuple(sorted(rng.sample(range(i), k=min(i, rng.randint(0, 2)))))
        cands.append(Candidate(f"v{i}", rng.choice([0, 64, 128, 256, 512]), float(rng.randint(1, 50)), reads,
                               rng.random() < 0.6, rng.random() < 0.85))
    return RematProblem(tuple(cands))


# ---------------------------------------------------------------------------
# the model


def test_closure_and_plan_of_a_chain():
    p = chain(4)
    plan = p.plan({1, 3})                   # keep v1 and v3: recompute v0 (from x) and v2 (from v1)
    assert plan.recompute == {0, 2} and plan.memory == 200 and plan.cost == 2.0
    assert p.segments(plan.recompute) == [100, 100]
    assert p.plan(set()).recompute == {0, 1, 2, 3} and p.segments(range(4)) == [400]
    assert p.keep_all().recompute == frozenset() and p.keep_all().memory == 400


def test_forced_values_and_infeasible_plans():
    p = RematProblem((Candidate("rand", 64, 1.0, (), True, False),       # a random op: always kept
                      Candidate("out", 0, 1.0, (0,), True, True),          # a graph output: free to keep
                      Candidate("mul", 64, 1.0, (0,), True, True)))
    assert p.forced() == {0, 1}
    assert p.closure(frozenset({1, 2})) is None          # recomputing 'rand' is not allowed
    assert brute_force(p, 64).keep == {0, 1}
    with pytest.raises(ValueError, match="no plan keeps at most 10 bytes"):
        milp(p, 10)
    with pytest.raises(ValueError, match="later candidate"):
        RematProblem((Candidate("a", 1, 1.0, (1,), True, True), Candidate("b", 1, 1.0, (), True, True)))


# ---------------------------------------------------------------------------
# milp is exact


@pytest.mark.parametrize("seed", range(12))
def test_milp_agrees_with_brute_force(seed):
    p = random_problem(seed, n=10 + seed % 3)
    forced = p.memory(p.forced())
    top = p.keep_all().memory
    for allowance in sorted({forced, (forced + top) // 2, top}):
        try:
            exact = brute_force(p, allowance)
        except ValueError:                    # nothing fits: milp says so too
            with pytest.raises(ValueError, match="no plan keeps"):
                milp(p, allowance)
            continue
        got = milp(p, allowance)
        assert got.memory <= allowance
        assert got.cost == pytest.approx(exact.cost), (seed, allowance)


# ---------------------------------------------------------------------------
# sqrt: Chen's √n checkpoints


@pytest.mark.parametrize("n, kept", [(16, 4), (25, 5), (100, 10), (10, 2)])
def test_sqrt_keeps_about_root_n(n, kept):
    plan = sqrt(chain(n))
    assert len(plan.keep) == kept
    assert plan.recompute == frozenset(range(n)) - plan.keep
    assert max(chain(n).segments(plan.recompute)) <= 100 * (n // kept + 1)


# ---------------------------------------------------------------------------
# knapsack and mincut: fit the allowance, near milp


@pytest.mark.parametrize("solver", [knapsack, mincut])
def test_fast_solvers_fit_the_allowance_on_a_chain(solver):
    p = chain(16)
    for allowance in (1600, 1000, 800, 400, 100, 0):
        plan = solver(p, allowance)
        assert plan.memory <= allowance, (solver.__name__, allowance, plan)
        if allowance >= 400:        # room for √n checkpoints: no recompute segment outgrows keep-all
            assert estimate(p, plan) <= p.keep_all().memory, (solver.__name__, allowance, plan)
    assert solver(p, 1600).recompute == frozenset()          # everything fits: nothing recomputed
    assert solver(p, 0).recompute == frozenset(range(16))    # nothing kept: everything recomputed from x


def test_knapsack_prefers_cheap_bytes():
    # needed values of equal size: the cheap ones (relu) are recomputed, the matmuls kept
    p = RematProblem((Candidate("mm", 100, 1000.0, (), True, True), Candidate("relu", 100, 1.0, (0,), True, True),
                      Candidate("mm_1", 100, 1000.0, (1,), True, True),
                      Candidate("relu_1", 100, 1.0, (2,), True, True)))
    assert knapsack(p, 200).recompute == {1, 3} and knapsack(p, 200).memory == 200
    assert mincut(p, 200).recompute == {1, 3}
    assert solve(p, Solver.MILP, 200).recompute == {1, 3}


def min_memory_brute_force(problem: RematProblem) -> int:
    forced = problem.forced()
    free = [i for i in range(len(problem)) if i not in forced]
    return min(problem.plan(forced | {free[b] for b in range(len(free)) if mask >> b & 1}).memory
               for mask in range(1 << len(free)))


@pytest.mark.parametrize("seed", range(12))
def test_minimum_and_fast_solvers_respect_the_allowance(seed):
    """``minimum`` is the least kept memory of any plan; at or above it every budget solver fits."""
    p = random_problem(seed, n=10 + seed % 3)
    least = minimum(p).memory
    assert least == min_memory_brute_force(p), seed
    top = p.keep_all().memory
    for allowance in sorted({least, (least + top) // 2, top}):
        for solver in (knapsack, mincut, milp):
            plan = solver(p, allowance)
            assert plan.memory <= allowance, (seed, solver.__name__, allowance)
            assert p.closure(plan.keep) == plan.recompute
    if least > 0:   # below the minimum nothing fits: milp says so, the others return the least they can keep
        with pytest.raises(ValueError, match="no plan keeps"):
            milp(p, least - 1)
        assert knapsack(p, least - 1).memory == mincut(p, least - 1).memory == least


@pytest.fixture(scope="module")
def zoo_problems():
    from mlcomp.frontend.joint import capture_joint, example_target
    from mlcomp.models import get
    from mlcomp.passes.remat.remat import build_problem

    out = {}
    for name in ("mlp", "lenet"):
        z = get(name)
        model, x = z.build().train(), z.example_inputs(4)
        graph = capture_joint(model, x, example_target(model, x, "cross_entropy"), name=name)
        out[name] = build_problem(graph)
    return out


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_fast_solvers_within_a_factor_of_milp_on_zoo_graphs(zoo_problems, name):
    """For the bytes a fast plan keeps, its recompute cost is within FACTOR of milp's optimum for those bytes."""
    p = zoo_problems[name]
    top = p.keep_all().memory
    factors = []
    for frac in (0.9, 0.75, 0.5):
        for solver in (knapsack, mincut):
            plan = solver(p, int(top * frac))
            best = milp(p, plan.memory)
            assert plan.cost >= best.cost * (1 - 1e-9)            # milp is optimal
            factors.append(plan.cost / best.cost if best.cost else 1.0)
    assert max(factors) <= FACTOR, (name, factors)


def test_solvers_are_pure():
    """Same problem, same plan: nothing depends on state a solver keeps or on the global generator."""
    for seed in range(12):
        p = random_problem(seed, 12)
        allowance = (p.keep_all().memory + minimum(p).memory) // 2    # feasible for every solver
        for s in Solver:
            first = solve(p, s, allowance)
            torch.manual_seed(seed)
            assert solve(p, s, allowance) == first, (seed, s)
