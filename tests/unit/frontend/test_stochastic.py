"""Training-mode randomness a static step would freeze (LayerDrop, SpecAugment) is refused before capture."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mlcomp.frontend.joint import LossKind, TrainingError, capture_joint
from mlcomp.frontend.stochastic import random_settings


class _Encoder(nn.Module):
    """Two layers; with ``config.layerdrop`` > 0 it skips each at random in training mode, as LayerDrop does."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.config = SimpleNamespace(**config)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        drop = getattr(self.config, "layerdrop", 0.0)
        for layer in self.layers:
            if not (self.training and drop > 0.0 and torch.rand([]) < drop):
                x = layer(x)
        return x


def test_layerdrop_is_refused_before_capture_with_the_setting_to_change():
    model = _Encoder(layerdrop=0.1, mask_time_prob=0.05, apply_spec_augment=True).eval()
    with pytest.raises(TrainingError) as info:
        capture_joint(model, (torch.randn(2, 4),), torch.randn(2, 4), loss=LossKind.MSE)
    err = info.value
    assert "config.layerdrop=0.1 skips whole layers at random" in err.what
    assert "config.mask_time_prob=0.05 masks random time steps drawn with NumPy" in err.what
    assert "model.config.layerdrop = 0.0 and model.config.mask_time_prob = 0.0" in err.hint
    assert not model.training                          # the user's module keeps its mode


def test_settings_that_are_off_do_not_refuse():
    assert random_settings(_Encoder(layerdrop=0.0, mask_time_prob=0.05, apply_spec_augment=False)) == []
    model = _Encoder(layerdrop=0.0)
    graph = capture_joint(model, (torch.randn(2, 4),), torch.randn(2, 4), loss=LossKind.MSE)
    assert sum(1 for n in graph.output_node.attrs["names"] if n.startswith("grad:")) == 4


def test_randomness_off_trains_the_step_without_it_and_restores_the_settings():
    import mlcomp

    torch.manual_seed(0)
    model = _Encoder(layerdrop=0.1, mask_time_prob=0.05, apply_spec_augment=True)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    art = mlcomp.compile(model, (x,), mode="train", target="cpu", loss="mse", optimizer="sgd", y=y,
                         randomness="off")
    assert art.verification["passed"] and art.verification["worst_rel"] == 0.0
    assert art.verification["randomness_off"] == [
        "config.layerdrop=0.1 skips whole layers at random, decided in Python (LayerDrop)",
        "config.mask_time_prob=0.05 masks random time steps drawn with NumPy (SpecAugment)"]
    assert model.config.layerdrop == 0.1 and model.config.mask_time_prob == 0.05     # the user's model as it was
    assert sum(1 for n in art.graph.output_node.attrs["names"] if n.startswith("grad:")) == 4   # both layers run
    with pytest.raises(TrainingError):                                             # the default still refuses
        mlcomp.compile(model, (x,), mode="train", target="cpu", loss="mse", optimizer="sgd", y=y)


def test_an_unknown_randomness_choice_is_refused():
    import mlcomp
    from mlcomp.base.errors import OptionError

    with pytest.raises(OptionError, match="randomness='sometimes' is not one of refuse, off"):
        mlcomp.compile(_Encoder(), (torch.randn(2, 4),), mode="train", loss="mse", randomness="sometimes")
