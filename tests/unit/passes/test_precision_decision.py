"""mixed-precision{dtype=auto} on a CPU reads the precision probe through PassContext and records its Decision."""
from __future__ import annotations

import pytest
import torch

from mlcomp.frontend.loading import load_model
from mlcomp.hardware.decide import Decision, DecisionPolicy, decide
from mlcomp.hardware.probe import PrecisionSpeeds
from mlcomp.passes.precision.mixed import MixedPrecision
from mlcomp.pipeline.pass_base import PassContext


@pytest.fixture(scope="module")
def mlp_graph():
    return load_model("mlp").capture()


def fake_probe(bf16_s: float, calls: list):
    """A probe that 'measures' bf16 at ``bf16_s`` against fp32 at 1 ms, by the real decision rule on fake samples."""
    def probe(device: str, dtypes: tuple[str, ...]) -> PrecisionSpeeds:
        calls.append((device, dtypes))
        ticks = iter(range(10 ** 6))
        decision = decide("bf16?", {"fp32": lambda: 1e-3, "bf16": lambda: bf16_s}, default="fp32",
                          policy=DecisionPolicy(warmup=0, budget_s=0.01), clock=lambda: next(ticks) * 1e-3)
        return PrecisionSpeeds(device, (64, 256, 256), {"fp32": 1e-3, "bf16": bf16_s}, (), {"bf16": decision})
    return probe


@pytest.mark.parametrize("bf16_s, dtype", [(0.4e-3, "bf16"), (20e-3, "fp32")])
def test_auto_decides_from_the_probe_in_the_context(mlp_graph, bf16_s, dtype):
    calls: list = []
    ctx = PassContext(precision_probe=fake_probe(bf16_s, calls))
    result = MixedPrecision().run(mlp_graph.copy(), ctx)
    assert result.stats["dtype"] == dtype and calls == [("cpu", ("bf16",))]
    (decision,) = result.stats["decisions"]
    assert (decision["choice"], decision["verdict"], decision["rounds"]) == (dtype, "decided", 6)
    again = MixedPrecision().run(mlp_graph.copy(), ctx)          # probed once per run (ctx.cache)
    assert again.stats["dtype"] == dtype and len(calls) == 1


def test_deterministic_auto_keeps_fp32_and_never_probes(mlp_graph):
    def never(device, dtypes):
        raise AssertionError("probed in a deterministic run")
    result = MixedPrecision().run(mlp_graph.copy(), PassContext(deterministic=True, precision_probe=never))
    assert result.stats["dtype"] == "fp32" and not result.changed
    decision = Decision.from_json(result.stats["decisions"][0])
    assert decision.verdict.value == "fixed" and decision.why.startswith("fixed rule (deterministic)")


def test_fp16_asked_on_a_deterministic_run_is_not_probed_for_its_warning(mlp_graph):
    def never(device, dtypes):
        raise AssertionError("probed in a deterministic run")
    result = MixedPrecision(dtype="fp16").run(mlp_graph.copy(), PassContext(deterministic=True, precision_probe=never))
    assert result.stats["dtype"] == "fp16" and "decisions" not in result.stats
    assert any(n.tensor_meta.dtype == torch.float16 for n in result.graph.call_nodes()
               if hasattr(n.meta, "dtype"))
