"""``bench --train`` and ``inspect --train``: the training table's figures come from the real joint graph."""
from __future__ import annotations

import json

import torch
from torch import nn

from mlcomp.analysis.training import phase_flops, predicted_peak, saved_activations
from mlcomp.frontend.joint import capture_joint, example_target
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.ir.node import Phase
from mlcomp.measure.training_bench import bench_training, format_rows


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def test_bench_training_row_agrees_with_the_analysis():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    row = bench_training(_model(), inputs=(x,), name="mlp3", policy=TimingPolicy(warmup=1, budget_s=0.05,
                                                                                min_repeats=3))
    graph = capture_joint(_model(), (x,), example_target(_model(), (x,), "cross_entropy"), name="mlp3")
    flops = phase_flops(graph)
    assert (row.forward_flops, row.loss_flops, row.backward_flops) == \
        (flops[Phase.FORWARD], flops[Phase.LOSS], flops[Phase.BACKWARD])
    # forward: 2*16*(32*64 + 64*64 + 64*10); backward: dW of all three, dX of the last two
    assert row.forward_flops == 2 * 16 * (32 * 64 + 64 * 64 + 64 * 10)
    assert row.backward_flops == 2 * 16 * (32 * 64 + 64 * 64 + 64 * 10) + 2 * 16 * (64 * 64 + 64 * 10)
    assert row.saved_bytes == sum(s.nbytes for s in saved_activations(graph))
    assert row.predicted_transient == predicted_peak(graph).transient
    assert row.grad_rel_error <= 1e-5
    assert row.eager.repeats >= 3 and row.compiled.repeats >= 3
    assert row.memory_method
    text = format_rows([row])
    assert "mlp3" in text and "peak memory: measured" in text and "bwd/fwd" in text


def test_cli_inspect_train_json():
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    result = CliRunner().invoke(main, ["inspect", "mlp", "--train", "--batch", "8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    flops = report["flops"]
    # the MLP's first layer needs no input gradient: backward = 2x forward minus that layer's dX
    assert flops["backward"] == 2 * flops["forward"] - 2 * 8 * 512 * 256
    assert report["saved_activation_bytes"] == sum(report["saved_bytes_by_module"].values())
    assert report["predicted_peak"]["transient_bytes"] > 0
