"""Model factories used by the CLI tests (`tests/data/factories.py:NAME`)."""
import torch
from torch import nn


class Branchy(nn.Module):
    """Data-dependent control flow: which branch runs depends on the input's values."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def branchy():
    return Branchy(), (torch.randn(2, 3),)


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU())


def small_mlp_with_inputs():
    return small_mlp(), (torch.randn(3, 8),)


def not_a_module():
    return 42
