"""The whole training step's peak: predicted (analysis.step_peak) against torch's CPU allocator, with the
optimizer after the graph and inside the backward; the fused step's parameters equal the unfused step's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.analysis.step_peak import OPTIMIZER, step_memory, update_points
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import MlcompError
from mlcomp.frontend.joint import LossKind, capture_joint
from mlcomp.ir.node import Phase
from mlcomp.hardware.peak_memory import MemorySource, PeakMemory
from mlcomp.models import LeNet
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.step import compile_training

OPTIMIZERS = ("sgd{lr=0.05}", "sgd{lr=0.05 momentum=0.9}", "sgd{lr=0.05 momentum=0.9 weight_decay=1e-3}",
              "adam{lr=1e-3}", "adamw{lr=1e-3 weight_decay=0.1}")


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


@pytest.fixture(scope="module")
def cnn():
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return capture_joint(small_cnn(), (x,), y, loss=LossKind.CROSS_ENTROPY), (x, y)


def measured(art, args) -> int:
    art.step(*args)                      # optimizer state exists before the measured step
    with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        art.step(*args)
    return mem.reading.growth


@pytest.mark.parametrize("spec", OPTIMIZERS)
def test_fused_update_gives_bit_identical_parameters_after_five_steps(cnn, spec):
    graph, args = cnn
    plain, fused = compile_training(graph, optimizer=spec), compile_training(graph, optimizer=spec,
                                                                            update_in_backward=True)
    assert fused.fused is not None and plain.fused is None
    losses = [(plain.step(*args).item(), fused.step(*args).item()) for _ in range(5)]
    assert all(a == b for a, b in losses) and losses[-1][0] < losses[0][0]
    before = {k: v.clone() for k, v in small_cnn().state_dict().items()}
    for key, value in plain.state_dict().items():
        assert torch.equal(value, fused.state_dict()[key]), key
    assert any(not torch.equal(before[k], v) for k, v in fused.state_dict().items())   # it did train
    assert fused.optimizer.state_dict()["state"].keys() == plain.optimizer.state_dict()["state"].keys()


@pytest.mark.parametrize("spec", [OPTIMIZERS[1], OPTIMIZERS[3]])
@pytest.mark.parametrize("fused", [False, True])
def test_predicted_step_peak_equals_the_allocator(cnn, spec, fused):
    graph, args = cnn
    predicted = step_memory(graph, workspace=op_workspaces(graph), scratch=OptimizerSpec.parse(spec).scratch(),
                            fused=fused)
    got = measured(compile_training(graph, optimizer=spec, update_in_backward=fused), args)
    assert abs(predicted.peak_bytes - got) <= 0.01 * got, (predicted.peak_bytes, got)


def test_lenet_fused_peak_is_lower_and_the_report_names_the_gradients():
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    torch.manual_seed(0)
    graph = capture_joint(LeNet(), (x,), y, loss=LossKind.CROSS_ENTROPY)
    ws = op_workspaces(graph)
    plain, fused = step_memory(graph, workspace=ws, scratch=1.0), step_memory(graph, workspace=ws, scratch=1.0,
                                                                              fused=True)
    update = len(plain.live_bytes) - 1         # the unfused update: every gradient, plus Adam's sqrt(v)
    params = sum(p.numel() * 4 for p in LeNet().parameters())
    assert plain.by_kind(update) == {"gradient": params, "optimizer scratch": params, "output": 4}
    assert plain.live_at(update)[-1].kind == "output" and plain.live_bytes[update] == 2 * params + 4
    assert graph.node(plain.at).ann.phase is Phase.BACKWARD and plain.by_kind()["gradient"] > 0
    assert fused.peak_bytes < plain.peak_bytes and len(fused.live_bytes) == len(plain.live_bytes) - 1
    assert "gradient" in fused.format() and "optimizer in the backward" in fused.format()


def test_update_points_follow_the_parameters_last_reader(cnn):
    graph, _ = cnn
    points = update_points(graph)
    order = {n: i for i, n in enumerate(graph.order())}
    for param, point in points.items():
        readers = [u.name for u in graph.users(param)]
        assert all(order[r] <= order[point] for r in readers), param
        assert order[f"grad:{param}"] <= order[point] if f"grad:{param}" in order else True


def test_loss_scaling_cannot_be_fused(cnn):
    graph, _ = cnn
    with pytest.raises(MlcompError, match="inf/NaN before any update"):
        compile_training(graph, optimizer="sgd", loss_scale=128.0, update_in_backward=True)


@pytest.mark.parametrize("name", ["mlp", "lenet", pytest.param("resnet18", marks=pytest.mark.slow),
                                  pytest.param("transformer", marks=pytest.mark.slow)])
def test_zoo_step_peak_prediction_equals_the_allocator(name):
    from mlcomp.measure.training_bench import training_case

    case = training_case(name, batch=4)
    graph, args = case.graph, case.args("cpu")
    ws = op_workspaces(graph)
    for spec, fused in (("sgd{lr=0.01 momentum=0.9}", False), ("adam{lr=1e-3}", True)):
        predicted = step_memory(graph, workspace=ws, scratch=OptimizerSpec.parse(spec).scratch(), fused=fused)
        got = measured(compile_training(graph, optimizer=spec, update_in_backward=fused), args)
        assert abs(predicted.peak_bytes - got) <= 0.01 * got, (name, spec, predicted.peak_bytes, got)


def test_a_copy_of_a_fused_artifact_steps_its_own_parameters(cnn):
    import copy

    graph, args = cnn
    art = compile_training(graph, optimizer="sgd{lr=0.05 momentum=0.9}", update_in_backward=True)
    before = {k: v.clone() for k, v in art.state_dict().items()}
    twin = copy.deepcopy(art)
    twin.step(*args)
    assert all(torch.equal(before[k], v) for k, v in art.state_dict().items())
    assert any(not torch.equal(before[k], v) for k, v in twin.state_dict().items())


@pytest.mark.parametrize("spec", ["sgd{lr=0.05 momentum=0.9}", "adam{lr=1e-3}"])
def test_a_fused_artifact_saves_and_reloads_fused(cnn, spec, tmp_path):
    import json

    graph, args = cnn
    art = compile_training(graph, optimizer=spec, update_in_backward=True)
    assert isinstance(art.fused, torch.jit.ScriptModule)        # the update is an op TorchScript calls
    art.step(*args)
    folder = art.save(tmp_path / "fused", inputs=args)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["update_in_backward"] and "fused.pt" in manifest["files"]
    assert "param_update" in art.fused.code                      # what fused.pt holds
    loaded = type(art).load(folder)
    assert isinstance(loaded.fused, torch.jit.ScriptModule) and loaded.verification["reload"]["passed"]
    for _ in range(3):
        art.step(*args), loaded.step(*args)
    for key, value in art.state_dict().items():                  # the same arithmetic, bit for bit
        assert torch.equal(value, loaded.state_dict()[key]), key
    plain = compile_training(graph, optimizer=spec)
    got = [measured(a, args) for a in (loaded, plain)]
    assert got[0] < got[1]                                        # the reloaded step keeps the lower peak
