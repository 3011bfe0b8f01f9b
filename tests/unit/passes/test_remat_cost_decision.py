"""remat{cost=profile}: node times come through PassContext.measure (decide.measure_times) and land in the
pass's decisions; a deterministic run times nothing and counts FLOPs."""
from __future__ import annotations

import torch
from torch import nn

import mlcomp.pipeline.pass_base as pass_base
from mlcomp.frontend.joint import LossKind, capture_joint
from mlcomp.hardware.decide import Verdict
from mlcomp.passes.remat.costs import CostModel, cost_model
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.pass_base import PassContext


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    return capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY), (x, y)


def test_deterministic_runs_count_flops_and_say_so():
    assert cost_model(CostModel.FLOPS, PassContext()) == (CostModel.FLOPS, None)
    assert cost_model(CostModel.PROFILE, PassContext()) == (CostModel.PROFILE, None)   # recorded when measured
    cost, decision = cost_model(CostModel.PROFILE, PassContext(deterministic=True))
    assert cost is CostModel.FLOPS and decision.verdict is Verdict.FIXED
    assert decision.why.startswith("fixed rule (deterministic): FLOP counts")


def test_profile_times_every_forward_node_through_the_context(monkeypatch):
    graph, inputs = _tiny()
    asked = []
    real = pass_base.measure_times

    def spy(question, fns, **kw):
        asked.append((question, len(fns)))
        return real(question, fns, **kw)

    monkeypatch.setattr(pass_base, "measure_times", spy)
    _, report = run_pipeline(graph, "remat{budget=0.5 cost=profile}", example_inputs=inputs)
    (decision,) = report.records[0].stats["decisions"]
    assert len(asked) == 1 and asked[0][0] == decision["question"] and asked[0][1] >= 5
    assert decision["choice"] == "profile" and decision["verdict"] == "decided"
    assert decision["why"].startswith("cost=profile asked; measured: ") and decision["rounds"] == 3
    _, report = run_pipeline(graph, "remat{budget=0.5 cost=profile}", example_inputs=inputs, deterministic=True)
    assert len(asked) == 1                               # nothing timed
    assert report.records[0].stats["decisions"][0]["choice"] == "flops"
