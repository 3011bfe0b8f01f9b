"""Compiling or exporting a user's module leaves it as it was: its train/eval mode and every weight and buffer."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mlcomp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("train_mode", [True, False])
def test_compile_keeps_the_callers_mode_and_weights(train_mode):
    model = _model().train(train_mode)
    model[1].eval()                                     # mixed modes survive too
    before_modes = [m.training for m in model.modules()]
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = mlcomp.compile(model, (torch.randn(4, 4),), target="cpu", pipeline="-O1")
    assert [m.training for m in model.modules()] == before_modes
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(4, 4)
    with torch.no_grad():
        expected = model.eval()(x)                       # the artifact is the eval-mode model
    torch.testing.assert_close(art(x), expected, rtol=1e-4, atol=1e-5)


def test_export_keeps_the_callers_mode(tmp_path):
    model = _model().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlcomp.export(model, tmp_path / "m.onnx", "onnx", example_inputs=(torch.randn(4, 4),))
    assert all(m.training for m in model.modules())
