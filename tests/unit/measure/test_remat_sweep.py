"""``mlcomp bench MODEL --train --remat-sweep``: every point's figures come from the real rewritten graph.

One small model is swept once (module scope): no remat, budget 1.0, a budget no
solver can meet and Chen's ``sqrt`` plan.  The checks are on memory and
gradients (never on wall-clock times): remat keeps gradients bitwise equal,
the liveness prediction of each rewritten graph agrees with the allocator's
measurement, and ``sqrt`` really keeps fewer activation bytes.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mlcomp.analysis.training_graph import saved_activations
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.ir.ops import INPUT
from mlcomp.measure.remat_sweep import (
    NONE,
    activation_bytes,
    grad_error,
    plot_sweeps,
    remat_spec,
    remat_sweep,
)
from mlcomp.measure.training_bench import training_case

POLICY = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=2, max_repeats=2)


def _chain() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 4))


@pytest.fixture(scope="module")
def case():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    return training_case(_chain(), inputs=(x,), name="chain6")


@pytest.fixture(scope="module")
def sweep(case):
    return remat_sweep(case, budgets=("1.0", "0.01", "sqrt"), policy=POLICY)


def test_points_in_order_with_the_reference_first(sweep):
    assert [p.label for p in sweep.points] == [NONE, "1.0", "0.01", "sqrt"]
    assert [p.spec for p in sweep.points[1:]] == [remat_spec("1.0"), remat_spec("0.01"), remat_spec("sqrt")]
    assert remat_spec("sqrt") == "remat{solver=sqrt}" and remat_spec("0.5", "knapsack") == \
        "remat{saved=0.5 solver=knapsack}"
    assert sweep.solver == "mincut" and sweep.batch == 64 and "allocator" in sweep.memory_method


def test_remat_keeps_gradients_and_the_prediction_tracks_the_measurement(sweep):
    for p in sweep.points:
        if not p.ok:
            continue
        assert p.grad_rel_error <= 1e-6 and p.grad_abs_error <= 1e-6, p.label
        assert p.measured_peak > 0 and p.step is not None and p.step.repeats == 2
        assert abs(p.predicted_peak - p.measured_peak) <= 0.10 * p.measured_peak, p.label


def test_sqrt_keeps_fewer_activations_and_budget_one_keeps_all(sweep):
    ref, one, sqrt = sweep.points[0], sweep.points[1], sweep.points[3]
    assert one.activation_bytes == ref.activation_bytes and sweep.saved_pct(one) == 0
    assert sqrt.ok and sqrt.activation_bytes < ref.activation_bytes
    assert sweep.saved_pct(sqrt) == pytest.approx(100 * (1 - sqrt.activation_bytes / ref.activation_bytes))
    assert sqrt.stats["nodes_recomputed"] > 0 and sqrt.stats["recompute_flops"] > 0


def test_a_budget_that_cannot_be_met_is_a_row_with_the_reason(sweep):
    p = sweep.points[2]
    assert not p.ok and p.step is None
    assert "within saved=0.01" in p.note and "minimum" in p.note
    text = sweep.format()
    assert "remat sweep: chain6, batch 64" in text and "cap not met" in text and f"0.01: {p.note}" in text
    data = json.loads(json.dumps(sweep.to_json()))
    assert [q["label"] for q in data["points"]] == [NONE, "1.0", "0.01", "sqrt"]
    assert data["points"][2]["measured_peak_bytes"] == 0 and data["points"][2]["note"] == p.note
    assert data["points"][3]["activation_saved_pct"] == pytest.approx(sweep.saved_pct(sweep.points[3]))


def test_activation_bytes_leave_inputs_out(case):
    g = case.graph
    saved = saved_activations(g)
    inputs = [s.nbytes for s in saved if g.node(s.name).op == INPUT]
    assert inputs == [64 * 64 * 4, 64 * 8]            # the batch (read by dW) and the labels (by the loss)
    assert activation_bytes(g) == sum(s.nbytes for s in saved) - sum(inputs) > 0


def test_grad_error_is_relative_per_parameter():
    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([10.0])}
    got = {"a": torch.tensor([1.0, -2.5]), "b": torch.tensor([10.0])}
    assert grad_error(got, ref) == (0.25, 0.5)


def test_plot_is_written(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.png"
    plot_sweeps([sweep], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_remat_sweep_needs_train():
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    result = CliRunner().invoke(main, ["bench", "mlp", "--remat-sweep", "--batch", "2"])
    assert result.exit_code == 2 and "--remat-sweep measures training steps" in result.output
    assert "Traceback" not in result.output
