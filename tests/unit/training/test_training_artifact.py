"""Training artifacts on disk, factories with their own loss, capabilities and the CLI's training output.

A two-layer model keeps this file cheap: one joint capture per module (fixture),
one CLI compile of a factory.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mlcomp
from mlcomp.base.errors import ArtifactError, VerificationError
from mlcomp.frontend.joint import TrainingError, capture_joint, resolve_loss
from mlcomp.frontend.loading import load_model
from mlcomp.ir import Mode
from mlcomp.targets import get_target
from mlcomp.training.step import (
    SAVED_FILES,
    TrainingArtifact,
    compile_training,
    training_targets,
)

FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn


def smoothed(out, y):
    return F.cross_entropy(out, y, label_smoothing=0.1)


def with_loss():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), (torch.randn(4, 8),), smoothed


def model_and_loss():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), smoothed
'''


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def joint():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    model = _model()
    return model, x, y, capture_joint(model, (x,), y, name="mlp_bn")


def test_save_load_repeats_the_step(joint, tmp_path):
    model, x, y, graph = joint
    art = compile_training(graph, optimizer="adam{lr=1e-2 betas=(0.8,0.99)}", state_keys=list(model.state_dict()))
    art.step(x, y)                                   # optimizer state exists (exp_avg, step)
    path = art.save(tmp_path / "art", inputs=(x, y))
    assert sorted(p.name for p in path.iterdir()) == sorted([*SAVED_FILES, "manifest.json", ".mlcomp"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "mlcomp-training" and manifest["optimizer"] == "adam{lr=0.01,betas=(0.8,0.99)}"
    assert (path / "joint.ir.txt").read_text().startswith("graph mlp_bn(")
    again = mlcomp.load(path)                        # checks itself: one step on the stored batch
    assert isinstance(again, TrainingArtifact) and again.graph is None and again.steps == 1
    assert again.verification["reload"]["passed"] and again.verification["reload"]["worst_rel"] == 0.0
    assert list(again.state_dict()) == list(model.state_dict())
    for _ in range(2):                               # the reloaded artifact keeps training like the original
        assert torch.equal(art.step(x, y), again.step(x, y))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in art.state_dict().items())
    assert again.optimizer.state_dict()["param_groups"][0]["betas"] == (0.8, 0.99)


def test_a_changed_folder_fails_its_reload_check(joint, tmp_path):
    model, x, y, graph = joint
    art = compile_training(graph, optimizer="sgd{lr=0.1}", state_keys=list(model.state_dict()))
    path = art.save(tmp_path / "art", inputs=(x, y))
    state = torch.load(path / "state.pt", weights_only=True)
    state["3.weight"] = state["3.weight"] + 0.01
    torch.save(state, path / "state.pt")
    with pytest.raises(VerificationError, match="does not repeat the saved step: 3.weight differs"):
        TrainingArtifact.load(path)
    (path / "manifest.json").write_text("{}")
    with pytest.raises(ArtifactError):
        mlcomp.load(path)


def test_save_needs_a_batch(joint, tmp_path):
    model, _, _, graph = joint
    art = compile_training(graph, optimizer="sgd", state_keys=list(model.state_dict()))
    with pytest.raises(mlcomp.MlcompError, match="needs a batch"):
        art.save(tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_cpu_and_cuda_declare_training():
    assert training_targets() == ["cpu", "cuda"]
    for name in ("cpu", "cuda"):
        assert Mode.TRAINING in get_target(name).capabilities.modes
    for name in ("onnxruntime", "tvm"):
        assert Mode.TRAINING not in get_target(name).capabilities.modes


def test_factory_returns_its_loss(tmp_path):
    (tmp_path / "fac.py").write_text(FACTORY)
    source = load_model(f"{tmp_path / 'fac.py'}:with_loss")
    assert source.loss_fn.__name__ == "smoothed" and source.inputs()[0].shape == (4, 8)
    assert resolve_loss(source, None) is source.loss_fn
    with pytest.raises(TrainingError, match=r"returns its own loss function \(smoothed\) and --loss mse"):
        resolve_loss(source, "mse", option="--loss")
    plain = load_model(f"{tmp_path / 'fac.py'}:model_and_loss", input_shapes=("4x8",))
    assert plain.loss_fn.__name__ == "smoothed"
    # the API trains with the factory's loss: the loss value is label-smoothed cross entropy
    art = mlcomp.compile(f"{tmp_path / 'fac.py'}:with_loss", mode="train", optimizer="sgd{lr=0.1}")
    x, y = source.inputs()[0], art.reference_inputs[-1]
    expected = F.cross_entropy(source.eager.train()(x), y, label_smoothing=0.1)
    torch.testing.assert_close(art.gradients(x, y)[0], expected.detach(), rtol=1e-6, atol=0)


def test_cli_compile_train_writes_a_loadable_folder(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    (tmp_path / "fac.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(main, ["compile", "fac.py:with_loss", "--train", "--loss", "mse", "-o", "bad"])
    assert refused.exit_code != 0 and "returns its own loss function (smoothed)" in refused.output
    assert not (tmp_path / "bad").exists()
    result = CliRunner().invoke(main, ["compile", "fac.py:with_loss", "--train", "--optimizer", "adamw{lr=1e-2}",
                                       "-o", "out"])
    assert result.exit_code == 0, result.output
    assert "parameters within 0.0e+00 relative" in result.output and "saved out" in result.output
    again = mlcomp.load(tmp_path / "out")
    assert again.verification["loss_fn"] == "smoothed" and again.verification["steps"]["worst_rel"] <= 1e-5
    # the loss value is kept beside the loss function's name (the name used to overwrite it)
    assert again.verification["loss"] == pytest.approx(again.verification["eager_loss"], rel=1e-5)
    assert again.verification["reload"]["passed"]
    before = copy.deepcopy(again.state_dict())
    again.step(*again.reference_inputs)
    assert not torch.equal(before["0.weight"], again.state_dict()["0.weight"])


def test_study_memory_reads_the_training_graph():
    from mlcomp.study.loop_memory import training_step_memory

    by_module, summary, data = training_step_memory("cpu", 8, (32, 16))
    # MLP 512-32-16-1, MSE: the backward keeps x (8x512) and y (8x1), both ReLUs' outputs and the last Linear's output
    assert data["saved_bytes_by_module"] == {"<input>": 8 * 512 * 4 + 8 * 4, "1": 8 * 32 * 4, "3": 8 * 16 * 4, "4": 8 * 4,
                                             "<loss>": 4}
    assert data["saved_bytes"] == sum(data["saved_bytes_by_module"].values())
    assert data["flops"]["forward"] == 2 * 8 * (512 * 32 + 32 * 16 + 16)
    assert data["predicted_transient"] > 0 and data["measured_growth"] >= 0
    assert [r[0] for r in by_module.rows][:1] == ["<input>"] and "saved activations" in summary.format()


def test_report_training_section_reads_the_joint_graph():
    from mlcomp.html_report import _training_section

    source = load_model(_model(), example_inputs=(torch.randn(4, 8),))
    text, data = _training_section(source)
    assert data["flops"]["forward"] == 2 * 4 * (8 * 16 + 16 * 3) and data["flops"]["backward"] > 0
    assert set(data["saved_bytes_by_module"]) >= {"<input>", "1", "2"}   # BatchNorm1d, ReLU by origin
    assert data["saved_bytes"] == sum(data["saved_bytes_by_module"].values())
    assert "saved activations" in text and "by module" in text


def test_cli_fused_update_saves_a_step_that_reloads_fused(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    (tmp_path / "fac.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["compile", "fac.py:with_loss", "--train", "--fused-update", "--optimizer",
                                       "adam{lr=1e-2}", "-o", "out"])
    assert result.exit_code == 0, result.output
    assert "parameters within 0.0e+00 relative" in result.output      # fused steps equal eager's
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["update_in_backward"] and manifest["host_memory"]["policy"] in ("return", "keep")
    again = mlcomp.load(tmp_path / "out")
    assert isinstance(again.fused, torch.jit.ScriptModule) and again.verification["reload"]["passed"]
    bad = CliRunner().invoke(main, ["compile", "fac.py:with_loss", "--train", "--host-memory", "arena", "-o", "x"])
    assert bad.exit_code != 0 and "'arena' is not one of" in bad.output and not (tmp_path / "x").exists()
