"""mixed-precision{dtype=auto} on a CPU reads the host's speeds from PassContext and records its Decision."""
from __future__ import annotations

import pytest
import torch

from mlcomp.frontend.loading import load_model
from mlcomp.hardware.decide import Decision, DecisionPolicy, decide
from mlcomp.hardware.probe import PrecisionSpeeds
from mlcomp.passes.precision.mixed import MixedPrecision
from mlcomp.pipeline import manager
from mlcomp.pipeline.manager import run_pipeline
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
def test_auto_decides_from_the_host_speeds_in_the_context(mlp_graph, bf16_s, dtype):
    calls: list = []
    ctx = PassContext(host_precision=fake_probe(bf16_s, calls)("cpu", ("bf16",)))
    result = MixedPrecision().run(mlp_graph.copy(), ctx)
    assert result.stats["dtype"] == dtype
    (decision,) = result.stats["decisions"]
    assert (decision["choice"], decision["verdict"], decision["rounds"]) == (dtype, "decided", 6)


@pytest.fixture
def never_probed(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("probed in a deterministic run")
    monkeypatch.setattr(manager, "host_precision_speeds", never)


def test_deterministic_auto_keeps_fp32_and_never_probes(mlp_graph, never_probed):
    out, report = run_pipeline(mlp_graph, "mixed-precision", deterministic=True)
    stats = report.records[0].stats
    assert stats["dtype"] == "fp32" and out.format() == mlp_graph.format()
    decision = Decision.from_json(stats["decisions"][0])
    assert decision.verdict.value == "fixed" and decision.why.startswith("fixed rule (deterministic)")


def test_fp16_asked_on_a_deterministic_run_is_not_probed_for_its_warning(mlp_graph, never_probed):
    out, report = run_pipeline(mlp_graph, "mixed-precision{dtype=fp16}", deterministic=True)
    stats = report.records[0].stats
    assert stats["dtype"] == "fp16" and "decisions" not in stats and not stats.get("warnings")
    assert any(n.tensor_meta.dtype == torch.float16 for n in out.call_nodes() if n.tensor_meta is not None)
