"""Plans aimed at the peak's moment: what they evict, that they lower the pool's lowest peak, and that the
step they give computes the same gradients bit for bit with the allocator's peak as predicted."""
from __future__ import annotations

import pytest
import torch

from mlcomp.analysis.step_peak import step_memory
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.frontend.joint import LossKind, capture_joint
from mlcomp.hardware.peak_memory import MemorySource, PeakMemory
from mlcomp.ir.node import Phase
from mlcomp.passes.remat.aimed import aim, held_for_later
from mlcomp.passes.remat.choose import score
from mlcomp.passes.remat.pool import pool
from mlcomp.passes.remat.remat import build_problem, rewrite
from mlcomp.passes.remat.solvers import Solver
from mlcomp.pipeline import run_pipeline
from mlcomp.training.step import compile_training
from tests.unit.passes.test_remat_monotone import random_model


@pytest.fixture(scope="module")
def joint():
    model, width = random_model(2)
    x = torch.randn(128, width, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (128,), generator=torch.Generator().manual_seed(2))
    return capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY, name="random2"), (x, y)


def _scored_pool(graph, fused: bool):
    """The pass's pool scored as the pass scores it (kernels' scratch included)."""
    problem, cache = build_problem(graph), {}
    rate = lambda plans: score(graph, problem, plans, rewrite, fused=fused,     # noqa: E731
                               workspace=lambda g: op_workspaces(g, cache=cache))
    return problem, rate, rate(pool(problem, Solver.KNAPSACK, None))


def _backward_read_steps(memory, root: str) -> list[int]:
    """The steps of the backward nodes that read ``root``'s buffer, through any value sharing it (a view):
    from the graph's users and the schedule's step of each node."""
    live, graph = memory.live, memory.graph
    sharing = [v for v, r in live.storage.items() if r == root]
    return sorted(live.step_of[u.name] for v in sharing for u in graph.users(v) if u.ann.phase is Phase.BACKWARD)


def test_held_values_are_saved_activations_read_only_after_the_peak(joint):
    graph, _ = joint
    memory = step_memory(graph)
    held = held_for_later(memory)
    at = memory.peak_step
    saved = {v.name for v in memory.live_at(at) if v.kind == "saved activation"}
    reads = {n: _backward_read_steps(memory, n) for n in saved}
    assert held and held <= saved
    assert all(reads[n] and reads[n][0] > at for n in held)             # read again only after the peak
    assert all(not reads[n] or reads[n][0] <= at for n in saved - held)   # the others: read by then, or never


@pytest.mark.parametrize("fused", [False, True])
def test_aimed_plans_go_below_the_pools_lowest_and_the_pass_takes_them(joint, fused):
    graph, _ = joint
    problem, rate, scored = _scored_pool(graph, fused)
    lowest = min(scored, key=lambda s: s.peak)
    aimed = [s for start in (scored[0], lowest) for s in aim(problem, start, rate)]   # from no remat, the lowest
    assert scored[0].plan == problem.keep_all()
    assert aimed and min(s.peak for s in aimed) < lowest.peak
    # the first aimed plan evicts one held value of the keep-all plan: its copy is born after that peak
    first, start = aimed[0], scored[0]
    (evicted,) = start.plan.keep - first.plan.keep
    name = problem.candidates[evicted].name
    assert name in held_for_later(start.memory)
    copy = next(n for n in first.graph.call_nodes() if n.name.startswith(f"{name}.remat"))
    assert first.memory.live.step_of[copy.name] > start.memory.peak_step
    stats = run_pipeline(graph, f"remat{{budget=0 fused={str(fused).lower()}}}")[1].records[0].stats
    assert stats["plan_aimed"] and stats["plans_aimed"] > 0
    assert stats["peak_after_bytes"] == stats["peak_lowest_bytes"] <= min(s.peak for s in aimed) < lowest.peak


def test_the_aimed_step_is_bit_identical_and_the_allocator_agrees(joint):
    graph, args = joint
    after, report = run_pipeline(graph, "remat{budget=0 fused=true}")
    stats = report.records[0].stats
    assert stats["plan_aimed"] and any(n.name.endswith(".remat") for n in after.call_nodes())
    (l0, g0), (l1, g1) = compile_training(graph).gradients(*args), compile_training(after).gradients(*args)
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    art = compile_training(after, optimizer="sgd{lr=0.01 momentum=0.9}", update_in_backward=True)
    art.step(*args)
    with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        art.step(*args)
    got = mem.reading.growth
    assert abs(got - stats["peak_after_bytes"]) <= 0.01 * got, (got, stats["peak_after_bytes"])
