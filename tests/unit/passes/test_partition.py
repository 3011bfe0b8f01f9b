"""partition: the cost table, the exact DP (against brute force), the splitter and the pass."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from mlcomp.analysis.parallel.placement_cost import PlacementCost
from mlcomp.analysis.parallel.pipeline_schedule import Schedule
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import evaluate
from mlcomp.ir.ops import aten
from mlcomp.ir.split import split_stages
from mlcomp.passes.placement.partition import Objective, Partition, PartitionError, even_cuts, plan_of, solve
from mlcomp.pipeline.pass_base import PassContext


def residual_graph(blocks: int = 3, width: int = 8):
    """x → [mm, relu, add(residual)]×blocks → output: every block's input crosses its inner cuts."""
    b = GraphBuilder("resmlp")
    h = b.input("x", (2, width))
    gen = torch.Generator().manual_seed(0)
    for k in range(blocks):
        w = b.param(f"l{k}.weight", torch.randn(width, width, generator=gen) / width ** 0.5)
        y = b.call(aten("mm"), h, w, name=f"mm{k}")
        y = b.call(aten("relu"), y, name=f"relu{k}")
        h = b.call(aten("add.Tensor"), y, h, name=f"add{k}")
    return b.output(h)


def test_cut_bytes_count_every_crossing_value():
    g = residual_graph(1)
    pc = PlacementCost.of(g)
    assert pc.units == (("mm0",), ("relu0",), ("add0",))
    row = 2 * 8 * 4
    # cut 1 (after mm0): mm0 and the residual x cross; cut 2: relu0 and x
    assert pc.cut_bytes == (0, 2 * row, 2 * row, 0)
    assert pc.cut_values == (0, 2, 2, 0)
    assert pc.params == (8 * 8 * 4, 0, 0) and pc.activations == (row, row, row)


def _brute(pc, stages, objective, **kw):
    best = None
    for cuts in itertools.combinations(range(1, pc.n), stages - 1):
        plan = plan_of(pc, cuts, backward=2.0 if kw.get("training") else 0.0, flight=lambda s: 1)
        if objective is Objective.THROUGHPUT:
            value = plan.bottleneck
        elif objective is Objective.LATENCY:
            value = sum(plan.stage_times)
        else:
            value = max(plan.stage_memory)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("objective", list(Objective))
def test_dp_returns_the_brute_force_optimum(seed, objective):
    g = residual_graph(3)
    rng = random.Random(seed)
    times = {n.name: rng.uniform(1e-5, 1e-3) for n in g.call_nodes()}
    pc = PlacementCost.of(g, times=times)
    for stages in (2, 3, 4):
        plan = solve(pc, stages, objective)
        got = {Objective.THROUGHPUT: plan.bottleneck, Objective.LATENCY: sum(plan.stage_times),
               Objective.MEMORY: max(plan.stage_memory)}[objective]
        assert got == pytest.approx(_brute(pc, stages, objective), rel=1e-9)
        assert len(plan.cuts) == stages - 1 and list(plan.cuts) == sorted(set(plan.cuts))


def test_memory_limit_is_respected_and_the_error_gives_the_minimum():
    g = residual_graph(3)
    pc = PlacementCost.of(g)
    least = solve(pc, 3, Objective.MEMORY).stage_memory
    plan = solve(pc, 3, memory_limit=max(least))
    assert max(plan.stage_memory) <= max(least)
    with pytest.raises(PartitionError, match=f"smallest limit any cut meets is {max(least)} bytes"):
        solve(pc, 3, memory_limit=max(least) - 1)
    with pytest.raises(PartitionError, match="has only 9 compute node"):
        solve(pc, 10)


def test_training_schedule_changes_what_is_in_flight():
    pc = PlacementCost.of(residual_graph(3))
    gpipe = solve(pc, 2, training=True, microbatches=4, schedule=Schedule.GPIPE)
    f1b = solve(pc, 2, training=True, microbatches=4, schedule=Schedule.ONE_F_ONE_B)
    # GPipe keeps all 4 microbatches' activations, 1F1B at most S - s
    assert gpipe.stage_memory[0] > f1b.stage_memory[0]


def test_pass_golden_ir_and_stats():
    g = residual_graph(1)
    result = Partition(stages=2).run(g, PassContext())
    assert result.changed
    assert result.graph.format() == (
        "graph resmlp(%x: f32[2, 8]) {\n"
        "  %l0.weight: f32[8, 8] = param   # l0\n"
        "  %mm0: f32[2, 8] = aten.mm.default(%x, %l0.weight)   # {stage=0}\n"
        "  %relu0: f32[2, 8] = aten.relu.default(%mm0)   # {stage=1}\n"
        "  %add0: f32[2, 8] = aten.add.Tensor(%relu0, %x)   # {stage=1}\n"
        "  return (%add0,)\n"
        "}")
    assert result.stats["stages"] == 2 and len(result.stats["cuts"]) == 1
    assert result.stats["balance"] >= 1.0 and len(result.stats["stage_ms"]) == 2
    again = Partition(stages=2).run(result.graph, PassContext())
    assert not again.changed


def test_splitter_golden_boundaries():
    g = residual_graph(2)
    stages = split_stages(g, {"mm0": 0, "relu0": 0, "add0": 0, "mm1": 1, "relu1": 2, "add1": 2})
    assert [s.receives for s in stages] == [("x",), ("add0",), ("add0", "mm1")]
    assert [s.sends for s in stages] == [("add0",), ("add0", "mm1"), ()]
    assert stages[1].graph.format() == (
        "graph resmlp_stage1(%add0: f32[2, 8]) {\n"
        "  %l1.weight: f32[8, 8] = param   # l1\n"
        "  %mm1: f32[2, 8] = aten.mm.default(%add0, %l1.weight)\n"
        "  return (%add0, %mm1)\n"
        "}")
    x = torch.randn(2, 8)
    vals = (x,)
    for s in stages:
        vals = evaluate(s.graph, *vals)
    torch.testing.assert_close(vals[0], evaluate(g, x)[0])


@pytest.fixture(scope="module", params=["mlp", "resnet18", "transformer"])
def zoo_graph(request, captured):
    return captured(request.param, batch=2)


def test_stages_in_sequence_equal_the_whole_graph(zoo_graph):
    module, inputs, graph = zoo_graph
    pc = PlacementCost.of(graph)
    with torch.no_grad():
        expected = module(*inputs)
    for stages in (2, 4):
        plan = solve(pc, stages)
        parts = split_stages(graph, pc.node_stage(plan.cuts))
        assert len(parts) == stages
        values = inputs
        for part in parts:
            values = evaluate(part.graph, *values)
        torch.testing.assert_close(values[0], expected, rtol=1e-4, atol=1e-5)
        # the plan is at least as balanced as cutting by layer count
        even = plan_of(pc, even_cuts(pc.n, stages), backward=0.0, flight=lambda s: 1)
        assert plan.bottleneck <= even.bottleneck + 1e-15
