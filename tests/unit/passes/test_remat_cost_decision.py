"""remat{cost=profile}: the cost model a run uses and its record; a deterministic run counts FLOPs instead."""
from __future__ import annotations

from mlcomp.hardware.decide import Verdict
from mlcomp.passes.remat.remat import CostModel, _cost_model
from mlcomp.pipeline.pass_base import PassContext


def test_profile_is_recorded_and_deterministic_runs_count_flops():
    assert _cost_model(CostModel.FLOPS, PassContext()) == (CostModel.FLOPS, None)
    cost, decision = _cost_model(CostModel.PROFILE, PassContext())
    assert cost is CostModel.PROFILE and decision.choice == "profile" and decision.why.startswith("fixed rule: ")
    cost, decision = _cost_model(CostModel.PROFILE, PassContext(deterministic=True))
    assert cost is CostModel.FLOPS and decision.verdict is Verdict.FIXED
    assert decision.why.startswith("fixed rule (deterministic): FLOP counts")
