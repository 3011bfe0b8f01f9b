"""``bench --train`` and ``inspect --train``: the training table's figures come from the real joint graph."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mlcomp.analysis.training_graph import phase_flops, predicted_peak, saved_activations
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
    assert row.predicted_transient == predicted_peak(graph).transient      # no convolution: no kernel scratch
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


# ---------------------------------------------------------------------------
# The memory model predicts the measurement (issue 12)


def test_allocator_peak_sees_every_free():
    """Live tensor bytes, event by event: 8 MiB at most (a and b), not the 10 MiB ever allocated."""
    from mlcomp.hardware.peak_memory import MemorySource, PeakMemory

    with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        a = torch.ones(1 << 20)             # 4 MiB
        b = torch.ones(1 << 20)
        del a
        c = torch.ones(1 << 19)             # 2 MiB, in a's place
        del b, c
    assert mem.reading.growth == 8 << 20
    assert mem.reading.end == 0
    assert "allocator" in mem.reading.method


@pytest.mark.parametrize("model", ["mlp", "lenet"])
def test_predicted_peak_within_10_percent_of_the_compiled_step(model):
    from mlcomp.analysis.workspace import op_workspaces
    from mlcomp.measure.training_bench import step_peak, training_case
    from mlcomp.training.step import compile_training

    case = training_case(model, batch=32)
    art = compile_training(case.graph, optimizer="sgd{lr=0.01 momentum=0.9}",
                           state_keys=list(case.model.state_dict()))
    args = case.args("cpu")
    measured = step_peak(lambda: art.step(*args), "cpu").growth
    scratch = op_workspaces(case.graph)
    predicted = predicted_peak(case.graph, scratch).transient
    assert measured > 256 << 10                       # activations and gradients, not noise
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
